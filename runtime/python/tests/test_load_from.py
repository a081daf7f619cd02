"""load_from: a checkpoint read outside any job, from a bucket (through the real `elastic-ckpt
restore`), and from what `elastic-ckpt pull`, `export` and `restore` write.

The step is committed as the agent commits it: every rank's staged `tensors.safetensors` pushed
as `rank-<R>/tensors.safetensors`, with the state's JSON skeleton in the manifest metadata.
`elastic-ckpt` is `$ELASTIC_CKPT`, else the workspace's `target/debug/elastic-ckpt` (the test
command builds it before these tests run)."""

import contextlib
import json
import os
import subprocess
import unittest
from unittest import mock

from tests import test_client as tc

er = tc.er
REPO = os.path.abspath(os.path.join(tc.CLIENT_DIR, "..", ".."))


def ckpt_exe():
    exe = os.environ.get("ELASTIC_CKPT") or os.path.join(REPO, "target", "debug", "elastic-ckpt")
    if not os.path.isfile(exe):
        raise AssertionError(f"{exe} not found: build the workspace first (cargo build --workspace)")
    return exe


class LoadFrom(tc.TorchEnv):
    def setUp(self):
        super().setUp()
        self.env(ELASTIC_CKPT=ckpt_exe())
        for k in ("RANK", "WORLD_SIZE", "ELASTIC_AGENT_SOCKET", "ELASTIC_RESUME_DIR", "ELASTIC_RESUME_STEP"):
            os.environ.pop(k, None)

    def ckpt(self, *args, ok=True):
        p = subprocess.run([ckpt_exe(), *args], capture_output=True, text=True, timeout=120)
        if ok and p.returncode != 0:
            raise AssertionError(f"elastic-ckpt {args}: {p.stderr}")
        return p

    def state(self, seed):
        torch = self.torch
        model, opt = self.make(seed)
        ema = self.make(seed + 100)[0]
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
        opt.step()  # a no-op without gradients, in the order the scheduler expects
        sched.step()
        return {"model": model, "ema": ema, "opt": opt, "sched": sched,
                "progress": {"seen": seed, "rng": torch.get_rng_state()}}

    def commit(self, step=5, world=2, seed=0, big=0, compress=False, bucket="bucket"):
        """Saves the state (of `seed`; with a tensor of `big` floats more) as `world` ranks and
        commits it to a file:// bucket as the agent does: in raw chunks, which a restore reads
        without copies, or with `compress` in chunks that compress (the big tensor then
        repeats), which it writes out."""
        st = self.state(seed)
        if big:
            torch = self.torch
            st["progress"]["big"] = (torch.arange(big) % (seed + 3)).float() if compress else torch.randn(big)
        staging = os.path.join(self.tmp.name, "staging")
        for r in range(world):
            self.env(ELASTIC_STAGING_DIR=staging, RANK=r, WORLD_SIZE=world)
            er.save(step, st)
        os.environ.pop("RANK")
        os.environ.pop("WORLD_SIZE")
        staged = os.path.join(staging, f"step-{step}")
        skeleton = tc.read_json(os.path.join(staged, "rank-0", "meta.json"))["state"]
        url = "file://" + os.path.join(self.tmp.name, bucket)
        self.ckpt("push", staged, url, "--step", str(step), "--world-size", str(world), "--chunk-mib", "1",
                  "--compress", "always" if compress else "never",
                  "--metadata", json.dumps({"elastic": {"generation": 1}, "state": skeleton}))
        return st, staged, url

    def assert_same(self, a, b, names=("model", "ema", "opt", "sched")):
        torch = self.torch

        def flat(v, out, at=""):
            if isinstance(v, torch.Tensor):
                out[at] = v
            elif isinstance(v, dict):
                for k, x in v.items():
                    flat(x, out, f"{at}/{k}")
            elif isinstance(v, (list, tuple)):
                for i, x in enumerate(v):
                    flat(x, out, f"{at}/{i}")
            else:
                out[at] = v
            return out

        for n in names:
            fa, fb = flat(a[n].state_dict(), {}), flat(b[n].state_dict(), {})
            self.assertEqual(sorted(fa), sorted(fb), n)
            for k in fa:
                if isinstance(fa[k], torch.Tensor):
                    self.assertTrue(torch.equal(fa[k], fb[k]), f"{n}{k}")
                else:
                    self.assertEqual(fa[k], fb[k], f"{n}{k}")

    def test_a_bucket_loads_the_whole_state_through_elastic_ckpt_restore(self):
        saved, _, url = self.commit()
        fresh = self.state(7)
        self.assertEqual(er.load_from(url, fresh), 5)
        self.assert_same(saved, fresh)
        self.assertEqual(fresh["progress"]["seen"], 0)
        self.assertTrue(self.torch.equal(fresh["progress"]["rng"], saved["progress"]["rng"]))
        # By number: the step, or an error naming what elastic-ckpt said.
        self.assertEqual(er.load_from(url, self.state(8), step=5), 5)
        with self.assertRaisesRegex(er.CheckpointUnavailable, "restore .* failed"):
            er.load_from(url, self.state(8), step=6)
        # Nothing of the temporary restore is left behind.
        leftovers = [n for n in os.listdir(os.environ.get("TMPDIR", "/tmp")) if n.startswith("elastic_run-load_from-")]
        self.assertEqual(leftovers, [])

    def test_a_bucket_is_read_into_the_states_own_tensors(self):
        saved, _, url = self.commit()
        fresh = self.state(7)
        opt = fresh["opt"]

        def held():
            out = {}
            for i, p in enumerate(fresh["model"].parameters()):
                out[i, "param"] = p.data_ptr()
                out.update({(i, k): t.data_ptr() for k, t in opt.state[p].items()})
            return out

        before = held()
        self.assertEqual(len(before), 4 * 4)  # 4 parameters, each with step, exp_avg, exp_avg_sq
        self.assertEqual(er.load_from(url, fresh), 5)
        self.assert_same(saved, fresh)
        self.assertEqual(held(), before, "a tensor of the model or optimizer was replaced")
        # A step that does not fit the state loads nothing: the restore is stopped once its
        # header is checked.
        wrong = self.state(9)
        ema = {k: v.clone() for k, v in wrong["ema"].state_dict().items()}
        wrong["model"] = self.torch.nn.Linear(8, 3)
        with self.assertRaisesRegex(er.StateError, "model"):
            er.load_from(url, wrong)
        for k, v in wrong["ema"].state_dict().items():
            self.assertTrue(self.torch.equal(v, ema[k]), k)
        leftovers = [n for n in os.listdir(os.environ.get("TMPDIR", "/tmp")) if n.startswith("elastic_run-load_from-")]
        self.assertEqual(leftovers, [])

    def test_the_restored_files_pages_are_given_back_as_they_are_read(self):
        from elastic_run import _load_from, _read

        # Compressed chunks, with writes into this process's memory off: the restore writes the
        # state file.
        self.enterContext(mock.patch.object(_load_from, "_INTO_PROCESS", False))
        saved, _, url = self.commit(big=600_000, compress=True)
        held = []
        finish = _read.RangedRead.finish

        def spy(self_):
            out = finish(self_)
            self.assertNotIsInstance(self_.f, _read.SourcedFile)
            st = os.fstat(self_.f.fd)
            held.append((st.st_blocks * 512, st.st_size))
            return out

        with mock.patch.object(_read.RangedRead, "finish", spy):
            fresh = self.state(7)
            self.assertEqual(er.load_from(url, fresh, work_dir=self.tmp.name), 5)
        self.assert_same(saved, fresh)
        self.assertTrue(self.torch.equal(fresh["progress"]["big"], saved["progress"]["big"]))
        [(allocated, size)] = held
        self.assertGreater(size, 2_400_000)
        # What stays is the header's page and the pages that two chunks' ranges share.
        self.assertLess(allocated, size // 8, f"{allocated} of {size} bytes still held once everything was read")
        self.assertEqual([n for n in os.listdir(self.tmp.name) if n.startswith("elastic_run-load_from-")], [])

    def test_a_restore_that_cannot_be_read_in_place_writes_into_the_states_tensors(self):
        from elastic_run import _read

        # Compressed chunks: the restore decodes them and writes each checked block straight
        # into the tensors, the state's own ones included.
        saved, _, url = self.commit(big=600_000, compress=True)
        seen = []
        finish = _read.RangedRead.finish

        def spy(self_):
            d = os.path.dirname(self_.f.path)
            seen.append((type(self_.f), self_.f.fd, sorted(os.listdir(d)), self_.out))
            return finish(self_)

        fresh = self.state(7)
        params = [p.data_ptr() for p in fresh["model"].parameters()]
        with mock.patch.object(_read.RangedRead, "finish", spy):
            self.assertEqual(er.load_from(url, fresh, work_dir=self.tmp.name), 5)
        self.assert_same(saved, fresh)
        self.assertTrue(self.torch.equal(fresh["progress"]["big"], saved["progress"]["big"]))
        [(kind, fd, written, out)] = seen
        # No file to read: only the metadata was written.
        self.assertEqual((kind, fd, written), (_read.HeaderFile, -1, ["metadata.json"]))
        self.assertEqual([p.data_ptr() for p in fresh["model"].parameters()], params)
        self.assertTrue(any(t.data_ptr() == params[0] for t in out.values()))

        # A reader that wants the file (here: as if a tensor were read into device memory)
        # answers with no targets, and gets the file, read as without writes into memory.
        seen.clear()
        with mock.patch.object(_read.RangedRead, "finish", spy), \
                mock.patch.object(_read.RangedRead, "in_place", lambda self_: None):
            fresh = self.state(8)
            self.assertEqual(er.load_from(url, fresh, work_dir=self.tmp.name), 5)
        self.assert_same(saved, fresh)
        [(kind, fd, written, _)] = seen
        self.assertEqual(kind, _read.TensorFile)
        self.assertGreaterEqual(fd, 0)
        self.assertEqual(len(written), 2, written)  # the metadata, and the state file being written

    def test_a_restore_that_is_not_the_loaders_child_writes_the_file(self):
        from elastic_run import _read

        # elastic-ckpt run through a shell that does not exec it: the restore's parent is the
        # shell, not the loader, and the loader's answer names the loader. Nothing is written
        # into the shell; the state file is, and it loads.
        saved, _, url = self.commit(big=600_000, compress=True)
        wrapper = os.path.join(self.tmp.name, "wrapped-elastic-ckpt")
        with open(wrapper, "w") as f:
            f.write(f'#!/bin/sh\n"{ckpt_exe()}" "$@"\n')
        os.chmod(wrapper, 0o755)
        self.env(ELASTIC_CKPT=wrapper)
        kinds = []
        finish = _read.RangedRead.finish

        def spy(self_):
            kinds.append(type(self_.f))
            return finish(self_)

        with mock.patch.object(_read.RangedRead, "finish", spy):
            fresh = self.state(7)
            self.assertEqual(er.load_from(url, fresh), 5)
        self.assert_same(saved, fresh)
        self.assertTrue(self.torch.equal(fresh["progress"]["big"], saved["progress"]["big"]))
        self.assertEqual(kinds, [_read.TensorFile])

    def test_raw_chunks_of_a_local_bucket_are_read_where_they_lie(self):
        from elastic_run import _read

        saved, _, url = self.commit(big=600_000)
        seen = []
        finish = _read.RangedRead.finish

        def spy(self_):
            d = os.path.dirname(self_.f.path)
            seen.append((type(self_.f), sorted(os.listdir(d)), sum(self_.f.entries[k].nbytes for k in self_.f.entries)))
            return finish(self_)

        with mock.patch.object(_read.RangedRead, "finish", spy):
            fresh = self.state(7)
            self.assertEqual(er.load_from(url, fresh, work_dir=self.tmp.name), 5)
        self.assert_same(saved, fresh)
        self.assertTrue(self.torch.equal(fresh["progress"]["big"], saved["progress"]["big"]))
        # Nothing but the metadata was written: every byte came from the bucket's chunks.
        [(kind, written, size)] = seen
        self.assertEqual((kind, written), (_read.SourcedFile, ["metadata.json"]))
        self.assertGreater(size, 2_400_000)

        # The store's URL as a user may write it: the restore names its chunks in normal form.
        bucket = url[len("file://"):]
        head, tail = os.path.split(bucket)
        fresh = self.state(9)
        self.assertEqual(er.load_from(f"file://{head}//./{tail}/", fresh), 5)
        self.assert_same(saved, fresh)

        # A chunk replaced after the restore checked it (here: as its first source is given),
        # by a rename or by the same bytes written again in place, is not read: the load
        # fails, naming it.
        add = _read.SourcedFile.add
        for how in ("renamed", "rewritten in place"):
            replaced = []

            def swap(self_, path, *a):
                if not replaced:
                    with open(path, "rb") as f:
                        data = f.read()
                    if how == "renamed":
                        os.rename(path, path + ".old")
                    with open(path, "r+b" if how != "renamed" else "wb") as f:
                        f.write(data)
                    replaced.append(path)
                return add(self_, path, *a)

            with self.subTest(how), mock.patch.object(_read.SourcedFile, "add", swap):
                with self.assertRaisesRegex(er.FormatError, "not the chunk the restore checked"):
                    er.load_from(url, self.state(8))
                self.assertTrue(replaced[0].startswith(bucket + "/"), replaced)

    def test_a_restore_without_copies_loads_from_the_chunks_its_sources_name(self):
        """The agent's restore with --restore-no-copy: rank-R/sources.json (built here from
        `elastic-ckpt restore --no-copy`'s events, as the agent builds it) in place of
        state.safetensors; `load` reads every byte from the store's chunks."""
        saved, _, url = self.commit(big=600_000)
        rank_dir = os.path.join(self.tmp.name, "resume", "rank-0")
        p = self.ckpt("restore", url, rank_dir, "--rank", "0", "--world-size", "1", "--events", "--no-copy")
        events = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
        [head] = [e for e in events if e["event"] == "header"]
        doc = {"version": 1, "store": url, "root": url[len("file://"):], "step": 5, "name": head["name"], "bytes": head["bytes"],
               "header": head["header"],
               "sources": [{k: e[k] for k in ("path", "bytes", "dev", "ino", "ctime_ns", "ranges")}
                           for e in events if e["event"] == "source"]}
        self.assertGreater(len(doc["sources"]), 2)
        sources = os.path.join(rank_dir, "sources.json")

        def write(d):
            with open(sources, "w") as f:
                json.dump(d, f)

        write(doc)
        self.assertEqual(sorted(os.listdir(rank_dir)), ["metadata.json", "sources.json"])
        resume = os.path.dirname(rank_dir)
        fresh = self.state(7)
        self.assertEqual(er.load(fresh, resume_dir=resume), 5)
        self.assert_same(saved, fresh)
        self.assertTrue(self.torch.equal(fresh["progress"]["big"], saved["progress"]["big"]))
        # load_from reads the same directory.
        fresh = self.state(8)
        self.assertEqual(er.load_from(resume, fresh), 5)
        self.assert_same(saved, fresh)

        # What is refused, naming it, with nothing read into the state.
        outside = dict(doc["sources"][0], path="/etc/passwd")
        for what, d, error in (
            ("a chunk outside the store", dict(doc, sources=[outside] + doc["sources"][1:]),
             "not a file in the store"),
            ("an unknown version", dict(doc, version=2), "unknown version 2"),
            ("a relative root", dict(doc, root="bucket"), "not an absolute path"),
            ("chunks outside the root", dict(doc, root="/elsewhere"), "not a file in the store"),
            ("a bool for a version", dict(doc, version=True), "unknown version"),
            ("bytes left without a source", dict(doc, sources=doc["sources"][1:]), "before the restore said"),
            ("another file's name", dict(doc, name="tensors.safetensors"), "not state.safetensors"),
        ):
            with self.subTest(what):
                write(d)
                fresh = self.state(9)
                before = fresh["model"].state_dict()["0.weight"].clone()
                with self.assertRaisesRegex(er.FormatError, error):
                    er.load(fresh, resume_dir=resume)
                if what != "bytes left without a source":  # refused before any read
                    self.assertTrue(self.torch.equal(fresh["model"].state_dict()["0.weight"], before))
        write(doc)

        # A chunk rewritten in place after the agent checked it is not read.
        chunk = doc["sources"][0]["path"]
        with open(chunk, "r+b") as f:
            data = f.read()
            f.seek(0)
            f.write(data)
        with self.assertRaisesRegex(er.FormatError, "not the chunk the restore checked"):
            er.load(self.state(9), resume_dir=resume)

    def test_a_newest_step_that_breaks_midway_is_dropped_for_the_older_one_whole(self):
        from elastic_run import _load_from

        # Raw chunks, read where they lie, and compressed ones, written into the tensors or
        # into a file.
        for compress, into in ((False, True), (True, True), (True, False)):
            with self.subTest(compress=compress, into=into), \
                    mock.patch.object(_load_from, "_INTO_PROCESS", into):
                self.newest_breaks_midway(compress, into)

    def newest_breaks_midway(self, compress, into):
        from elastic_run import _read

        bucket = f"bucket-{compress}-{into}"
        older, _, url = self.commit(step=4, seed=1, big=4_000_000, compress=compress, bucket=bucket)
        newer, _, _ = self.commit(step=5, seed=2, big=4_000_000, compress=compress, bucket=bucket)
        shown = json.loads(self.ckpt("--json", "show", url, "--step", "5").stdout)
        keys = [o["key"] for o in shown["objects"]]
        self.assertGreaterEqual(len(keys), 3, "the step needs several chunks")
        codecs = [o["codec"] if isinstance(o["codec"], str) else o["codec"]["name"] for o in shown["objects"]]
        self.assertEqual(any(c != "raw" for c in codecs), compress, codecs)
        bucket = url[len("file://"):]
        # One chunk at a time, in order: the first chunk of step 5 is read into the state
        # before a later one fails.
        self.env(ELASTIC_CKPT_CONCURRENCY=1)
        calls = []
        spies = contextlib.ExitStack()
        self.addCleanup(spies.close)
        for name in ("ready", "abandon"):
            def spy(self_, *a, _f=getattr(_read.RangedRead, name), _n=name):
                self.assertEqual(isinstance(self_.f, _read.SourcedFile), not compress)
                self.assertEqual(isinstance(self_.f, _read.HeaderFile), not compress or into)
                calls.append((_n, self_.f.metadata["elastic.step"]))
                return _f(self_, *a)
            p = mock.patch.object(_read.RangedRead, name, spy)
            p.start()
            spies.callback(p.stop)
        for how in ("flipped", "cut"):
            with self.subTest(how):
                path = os.path.join(bucket, keys[-1])
                with open(path, "rb") as f:
                    good = f.read()
                bad = good[:len(good) // 2] if how == "cut" else good[:100] + bytes([good[100] ^ 1]) + good[101:]
                with open(path, "wb") as f:
                    f.write(bad)
                calls.clear()
                fresh = self.state(7)
                self.assertEqual(er.load_from(url, fresh), 4)
                self.assert_same(older, fresh)
                self.assertTrue(self.torch.equal(fresh["progress"]["big"], older["progress"]["big"]))
                files = list(dict.fromkeys(path for _, path in calls))
                if how == "cut":
                    # A chunk of the wrong length is found before the step is read at all.
                    self.assertEqual(len(files), 1, calls)
                else:
                    self.assertEqual(len(files), 2, calls)
                    self.assertIn(("ready", files[0]), calls)
                    self.assertIn(("abandon", files[0]), calls)
                    self.assertLess(calls.index(("abandon", files[0])), calls.index(("ready", files[1])))
                self.assertIn(("ready", files[-1]), calls)
                with open(path, "wb") as f:
                    f.write(good)
        # Whole again, the newest step loads.
        fresh = self.state(7)
        self.assertEqual(er.load_from(url, fresh), 5)
        self.assert_same(newer, fresh)
        spies.close()

    def test_a_staged_snapshot_and_a_restored_directory_load_whole(self):
        saved, staged, url = self.commit()
        fresh = self.state(7)
        self.assertEqual(er.load_from(staged, fresh), 5)
        self.assert_same(saved, fresh)
        restored = os.path.join(self.tmp.name, "restored")
        self.ckpt("restore", url, restored, "--rank", "0", "--world-size", "1")
        fresh = self.state(9)
        self.assertEqual(er.load_from(restored, fresh), 5)
        self.assert_same(saved, fresh)
        with self.assertRaisesRegex(er.FormatError, "holds step 5, not step 4"):
            er.load_from(restored, self.state(9), step=4)

    def test_a_pulled_step_loads_its_modules_and_names_what_it_cannot_hold(self):
        saved, _, url = self.commit()
        pulled = os.path.join(self.tmp.name, "pulled")
        self.ckpt("pull", url, pulled)
        fresh = self.state(7)
        self.assertEqual(er.load_from(pulled, {"model": fresh["model"], "ema": fresh["ema"]}, strict=False), 5)
        self.assert_same(saved, fresh, names=("model", "ema"))
        # The optimizer's state needs the JSON skeleton a pull does not bring.
        with self.assertRaisesRegex(er.StateError, "holds no JSON state"):
            er.load_from(pulled, self.state(8))

    def test_an_exported_entry_loads_into_a_module_and_one_entry_only(self):
        saved, _, url = self.commit()
        out = os.path.join(self.tmp.name, "export")
        self.ckpt("export", url, out, "--key", "ema")
        fresh = self.state(7)
        self.assertEqual(er.load_from(out, {"ema": fresh["ema"]}), 5)
        self.assert_same(saved, fresh, names=("ema",))
        with self.assertRaisesRegex(er.StateError, "one entry"):
            er.load_from(out, {"model": fresh["model"], "ema": fresh["ema"]})
        # A module of another shape is refused before anything loads.
        torch = self.torch
        other = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
        before = [p.clone() for p in other.parameters()]
        with self.assertRaises(er.StateError):
            er.load_from(out, {"m": other})
        self.assertTrue(all(torch.equal(a, b) for a, b in zip(before, other.parameters())))

    def test_what_is_no_checkpoint_is_named(self):
        with self.assertRaisesRegex(er.FormatError, "neither a checkpoint URL nor a directory"):
            er.load_from(os.path.join(self.tmp.name, "nothing"), {})
        empty = os.path.join(self.tmp.name, "empty")
        os.mkdir(empty)
        with self.assertRaisesRegex(er.FormatError, "not a checkpoint directory"):
            er.load_from(empty, {})
        with self.assertRaisesRegex(er.CheckpointUnavailable, "failed"):
            er.load_from("file://" + empty, {})
        with self.assertRaisesRegex(ValueError, "not a step number"):
            er.load_from(empty, {}, step=-1)


class RestoreEvents(tc.TorchEnv):
    """How load_from follows `elastic-ckpt restore --events` when it reads them late: a step
    whose file is already gone (it failed) is skipped, and a file already renamed into place
    (the restore ended) is read there."""

    def setUp(self):
        super().setUp()
        for k in ("RANK", "WORLD_SIZE"):
            os.environ.pop(k, None)
        self.dest = os.path.join(self.tmp.name, "restored")
        os.mkdir(self.dest)

    def feed(self, load, *events):
        for ev in events:
            load.event(json.dumps(ev).encode() + b"\n")

    def step(self, n):
        return {"event": "step", "step": n, "metadata": {"step": n, "rank": 0, "world_size": 1,
                                                         "metadata": {"state": {}}}}

    def file(self, n, path, size=1000):
        return {"event": "file", "step": n, "name": "state.safetensors", "path": path, "bytes": size}

    def test_a_step_whose_file_is_gone_is_skipped_and_a_renamed_file_is_read_where_it_is(self):
        from safetensors.torch import save_file

        from elastic_run import _load_from

        load = _load_from._Overlapped("file:///b", self.dest, {}, True)
        gone = os.path.join(self.dest, ".state.safetensors.tmp-1")
        # Step 6 failed before its events were read: nothing of it exists any more.
        self.feed(load, self.step(6), self.file(6, gone),
                  {"event": "ready", "step": 6, "name": "state.safetensors", "ranges": [[100, 8]]},
                  {"event": "failed", "step": 6, "error": "corrupt"})
        with self.assertRaisesRegex(er.CheckpointUnavailable, "without restoring a step"):
            load.finish()
        # Step 5 ended, and renamed its file, before its events were read.
        t = self.torch.arange(10, dtype=self.torch.float32)
        save_file({"model/w": t}, os.path.join(self.dest, "state.safetensors"), metadata={"elastic.step": "5"})
        size = os.path.getsize(os.path.join(self.dest, "state.safetensors"))
        self.feed(load, self.step(5), self.file(5, os.path.join(self.dest, ".state.safetensors.tmp-2"), size),
                  {"event": "ready", "step": 5, "name": "state.safetensors", "ranges": [[size - 40, 40]]})
        step, tensors, rest, shards = load.finish()
        self.assertEqual((step, rest, shards), (5, {}, {}))
        self.assertTrue(self.torch.equal(tensors["model/w"], t))
        # Its own name holding another step's file means the step is gone too.
        load = _load_from._Overlapped("file:///b", self.dest, {}, True)
        self.feed(load, self.step(7), self.file(7, os.path.join(self.dest, ".state.safetensors.tmp-3")))
        self.assertTrue(load.gone)
        # A range outside the data, or given twice, is refused.
        load = _load_from._Overlapped("file:///b", self.dest, {}, True)
        ready = {"event": "ready", "step": 5, "name": "state.safetensors", "ranges": [[size - 40, 40]]}
        self.feed(load, self.step(5), self.file(5, os.path.join(self.dest, ".x"), size), ready)
        with self.assertRaisesRegex(er.FormatError, "given as ready twice"):
            self.feed(load, ready)
        with self.assertRaisesRegex(er.FormatError, "outside its data"):
            self.feed(load, {**ready, "ranges": [[0, 8]]})
        load.abandon()
        # A path outside the directory it was given is refused.
        load = _load_from._Overlapped("file:///b", self.dest, {}, True)
        with self.assertRaisesRegex(er.FormatError, "outside"):
            self.feed(load, self.step(5), self.file(5, "/etc/.passwd"))

    def saved(self):
        """A tensor saved as step 5 in a safetensors file: ``(tensor, the file's bytes, its
        header's length, the header event of a restore that does not write it)``."""
        import struct

        from safetensors.torch import save_file

        t = self.torch.arange(10, dtype=self.torch.float32)
        written = os.path.join(self.tmp.name, "w.safetensors")
        save_file({"model/w": t}, written, metadata={"elastic.step": "5"})
        with open(written, "rb") as f:
            raw = f.read()
        (n,) = struct.unpack("<Q", raw[:8])
        header = {"event": "header", "step": 5, "name": "state.safetensors", "bytes": len(raw),
                  "header": raw[8:8 + n].decode()}
        return t, raw, n, header

    def test_sources_are_files_of_the_store_and_only_of_a_step_restored_without_copies(self):
        from safetensors.torch import save_file

        from elastic_run import _load_from

        t, raw, n, header = self.saved()
        bucket = os.path.join(self.tmp.name, "b")
        os.makedirs(os.path.join(bucket, "steps"))
        chunk = os.path.join(bucket, "steps", "c.bin")
        with open(chunk, "wb") as f:
            f.write(b"\0" * 3 + raw[8 + n:])
        st = os.stat(chunk)

        def source(path, ranges=None, **kw):
            return {"event": "source", "step": 5, "name": "state.safetensors", "path": path, "bytes": st.st_size,
                    "dev": st.st_dev, "ino": st.st_ino, "ctime_ns": st.st_ctime_ns,
                    "ranges": ranges or [[8 + n, 40, 3]], **kw}

        # Read from the chunk, at the offsets given, however the store's URL and the chunk's
        # path are written (a backslash is a slash in a file URL).
        tmp = os.path.dirname(bucket)
        for url, path in [("file://" + bucket, chunk),
                          ("file://" + tmp + "//./b/", bucket + "//steps/./c.bin"),
                          ("file://" + tmp + "\\b", chunk),
                          ("file://" + bucket.replace("/", "\\"), chunk),
                          ("file:///" + bucket, "/" + chunk),
                          ("FILE://LocalHost" + bucket, chunk)]:
            with self.subTest(url):
                load = _load_from._Overlapped(url, self.dest, {}, True)
                self.feed(load, self.step(5), header, source(path))
                step, tensors, _, _ = load.finish()
                self.assertEqual(step, 5)
                self.assertTrue(self.torch.equal(tensors["model/w"], t))
                self.assertEqual(os.listdir(self.dest), [])
        for bad, want in [(source("/etc/passwd"), "not a file in the store"),
                          (source(bucket + "/steps/../../x"), "not a file in the store"),
                          (source(bucket + "/steps/../steps/c.bin"), "not a file in the store"),
                          (source("steps/c.bin"), "not a file in the store"),
                          (source(chunk + "\0"), "not a file in the store"),
                          (source(bucket + "/\ud800"), "not a file in the store"),
                          (source(chunk, [[8 + n, 40, st.st_size - 39]]), "length, offset in a file of"),
                          (source(chunk, [[8 + n, 40, 3], [8 + n + 20, 20, 23]]), "said to lie in two places"),
                          (source(chunk, [[len(raw) - 4, 8, 0]]), "not \\[offset in"),
                          (source(chunk, bytes=-1), "is given as"),
                          (source(chunk, ctime_ns=None), "is given as"),
                          ({**header, "header": "\udc80"}, "header is not UTF-8"),
                          ({"event": "ready", "step": 5, "name": "state.safetensors", "ranges": [[8 + n, 40]]},
                           "a ready event for a state file that is read from the store's chunks")]:
            with self.subTest(want):
                load = _load_from._Overlapped("file://" + bucket, self.dest, {}, True)
                with self.assertRaisesRegex(er.FormatError, want):
                    self.feed(load, self.step(5), *([header] if bad["event"] != "header" else []), bad)
                load.abandon()
        # A source for a step whose file was written, or from a store that is not a directory.
        load = _load_from._Overlapped("file://" + bucket, self.dest, {}, True)
        save_file({"model/w": t}, os.path.join(self.dest, ".x"), metadata={"elastic.step": "5"})
        with self.assertRaisesRegex(er.FormatError, "a source event for a state file that is not read"):
            self.feed(load, self.step(5), self.file(5, os.path.join(self.dest, ".x"), len(raw)), source(chunk))
        load.abandon()
        for url in ("s3://b/j", "file://elsewhere" + bucket, "file://" + tmp + "/a%2F..%2Fb"):
            load = _load_from._Overlapped(url, self.dest, {}, True)
            with self.assertRaisesRegex(er.FormatError, "not a file in the store"):
                self.feed(load, self.step(5), header, source(chunk))
            load.abandon()

    def test_a_header_that_asks_for_targets_is_answered_with_the_tensors_addresses(self):
        import ctypes

        from safetensors.torch import save_file

        from elastic_run import _load_from

        t, raw, n, header = self.saved()
        header = {**header, "targets": True}
        ready = {"event": "ready", "step": 5, "name": "state.safetensors", "ranges": [[8 + n, 40]]}

        def begin():
            load = _load_from._Overlapped("s3://b/j", self.dest, {}, True)
            r, w = os.pipe()
            self.addCleanup(os.close, r)
            self.addCleanup(os.close, w)
            load.answer_fd = w
            self.feed(load, self.step(5), header)
            answer = json.loads(os.read(r, 1 << 16))
            return load, answer

        # The answer names the step, the file and where its one tensor's 40 bytes go; once
        # the restore has written them there (here, by hand) and said so, they load.
        load, answer = begin()
        [[offset, length, addr]] = answer.pop("targets")
        self.assertEqual((answer, offset, length),
                         ({"step": 5, "name": "state.safetensors", "pid": os.getpid()}, 8 + n, 40))
        ctypes.memmove(addr, raw[8 + n:], 40)
        self.feed(load, ready)
        step, tensors, _, _ = load.finish()
        self.assertEqual(step, 5)
        self.assertTrue(self.torch.equal(tensors["model/w"], t))
        self.assertEqual(tensors["model/w"].data_ptr(), addr)
        # Bytes never said to be there, a source event, or a header asking for an answer where
        # none can go, are refused.
        load, _ = begin()
        with self.assertRaisesRegex(er.FormatError, "0 of the 40 bytes"):
            load.finish()
        load, _ = begin()
        with self.assertRaisesRegex(er.FormatError, "a source event for a state file that is not read"):
            self.feed(load, {"event": "source", "step": 5, "name": "state.safetensors", "path": "/x", "bytes": 1,
                             "dev": 1, "ino": 1, "ctime_ns": 1, "ranges": [[8 + n, 1, 0]]})
        load.abandon()
        load = _load_from._Overlapped("s3://b/j", self.dest, {}, True)
        with self.assertRaisesRegex(er.FormatError, "unexpected header event"):
            self.feed(load, self.step(5), header)
        # With writes into memory off, the answer is none, and the file event that follows is
        # read as usual; so is a file event that follows an answer with targets, when the
        # restore may not write into memory after all. Once a range is said to be in memory,
        # a file event is refused.
        path = os.path.join(self.dest, ".state.safetensors.tmp-5")
        save_file({"model/w": t}, path, metadata={"elastic.step": "5"})
        with mock.patch.object(_load_from, "_INTO_PROCESS", False):
            load, answer = begin()
        self.assertEqual(answer, {"step": 5, "name": "state.safetensors", "pid": os.getpid(), "targets": None})
        load2, answer = begin()
        self.assertIsNotNone(answer["targets"])
        for load in (load, load2):
            self.feed(load, self.file(5, path, len(raw)), ready)
            _, tensors, _, _ = load.finish()
            self.assertTrue(self.torch.equal(tensors["model/w"], t))
        load, _ = begin()
        self.feed(load, {**ready, "ranges": [[8 + n, 4]]})
        with self.assertRaisesRegex(er.FormatError, "unexpected file event"):
            self.feed(load, self.file(5, path, len(raw)))
        load.abandon()


if __name__ == "__main__":
    unittest.main()
