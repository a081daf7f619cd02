"""Reading a restored safetensors file straight into the state: the header checks, reads into a
module's own tensors, and a checkpoint that does not fit loading nothing.

python -m unittest discover -s runtime/python/tests -t runtime/python"""

import json
import os
import struct
from unittest import mock

from tests import test_client as tc

er = tc.er
_read = er._read


def safetensors_bytes(header, data=b"", pad=True):
    h = json.dumps(header).encode()
    if pad:
        h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


class Header(tc.TorchEnv):
    """Every rule safetensors applies to a header, applied by the client's own reader."""

    def write(self, raw, name="t.safetensors"):
        path = os.path.join(self.tmp.name, name)
        with open(path, "wb") as f:
            f.write(raw)
        return path

    def refused(self, raw, pattern):
        path = self.write(raw)
        with self.assertRaisesRegex(er.FormatError, pattern):
            with _read.TensorFile(path) as f:
                f.read()

    def test_a_valid_file_reads_every_dtype_bitwise(self):
        torch = self.torch
        from safetensors.torch import save_file

        tensors = {
            "f32": torch.randn(3, 5), "bf16": torch.randn(7).to(torch.bfloat16),
            "f16": torch.randn(2, 2).half(), "f64": torch.randn(4).double(), "i64": torch.arange(-3, 9),
            "u8": torch.arange(200, dtype=torch.uint8), "b": torch.tensor([True, False, True]),
            "i8": torch.tensor([-128, 127], dtype=torch.int8), "u16": torch.arange(9).to(torch.uint16),
            "f8": torch.randn(6).to(torch.float8_e4m3fn), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
        }
        path = os.path.join(self.tmp.name, "ok.safetensors")
        save_file(tensors, path, metadata={"k": "v"})
        with _read.TensorFile(path) as f:
            self.assertEqual(f.metadata, {"k": "v"})
            got = f.read()
        self.assertEqual(set(got), set(tensors))
        for k, t in tensors.items():
            self.assertEqual(got[k].dtype, t.dtype, k)
            self.assertEqual(got[k].shape, t.shape, k)
            self.assertTrue(torch.equal(got[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), k)

    def test_headers_that_break_a_rule_are_format_errors_naming_the_file(self):
        t = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
        cases = [
            (b"short", r"t.safetensors: not a safetensors file: 5 bytes, shorter than the header length"),
            (struct.pack("<Q", 10**9) + b"{}", r"a header of 1000000000 bytes, over the limit"),
            (struct.pack("<Q", 64) + b"{}", r"a header of 64 bytes in a file of 10"),
            (safetensors_bytes([1, 2]), r"the header is \[1, 2\], not a JSON object"),
            (struct.pack("<Q", 4) + b"{x}]", r"t.safetensors: header: not JSON"),
            (safetensors_bytes({"__metadata__": {"a": 1}}), r"__metadata__ is not an object of strings"),
            (safetensors_bytes({"t": dict(t, dtype="F33")}, b"\0" * 8), r"tensor 't' has the unknown dtype 'F33'"),
            (safetensors_bytes({"t": dict(t, shape=[-2])}, b"\0" * 8), r"tensor 't' has the shape \[-2\]"),
            (safetensors_bytes({"t": dict(t, shape=[True])}, b"\0" * 8), r"tensor 't' has the shape \[True\]"),
            (safetensors_bytes({"t": dict(t, data_offsets=[8, 0])}, b"\0" * 8), r"has the data offsets \[8, 0\]"),
            (safetensors_bytes({"t": dict(t, data_offsets=[0, 12])}, b"\0" * 12), r"12 bytes for shape \[2\] of F32"),
            (safetensors_bytes({"t": dict(t, extra=1)}, b"\0" * 8), r"tensor 't' is .*not \{dtype, shape, data_offsets\}"),
            (safetensors_bytes({"t": t, "u": t}, b"\0" * 8), r"tensor '.' starts at byte 0 of the data, not 8"),
            (safetensors_bytes({"t": dict(t, data_offsets=[4, 12])}, b"\0" * 12), r"tensor 't' starts at byte 4"),
            (safetensors_bytes({"t": t}, b"\0" * 9), r"the tensors end at byte \d+, the file at \d+"),
            (safetensors_bytes({"t": t}, b"\0" * 7), r"the tensors end at byte \d+, the file at \d+"),
        ]
        for i, (raw, pattern) in enumerate(cases):
            with self.subTest(case=i, pattern=pattern):
                self.refused(raw, pattern)

    def test_a_fifo_or_a_directory_in_its_place_is_refused_without_hanging(self):
        path = os.path.join(self.tmp.name, "fifo.safetensors")
        os.mkfifo(path)
        with self.assertRaisesRegex(er.FormatError, r"fifo.safetensors: not a regular file"):
            _read.TensorFile(path)
        with self.assertRaisesRegex(er.FormatError, r"not a regular file"):
            _read.TensorFile(self.tmp.name)
        with self.assertRaisesRegex(er.FormatError, r"nothing.safetensors: missing"):
            _read.TensorFile(os.path.join(self.tmp.name, "nothing.safetensors"))

    def test_a_file_cut_while_it_is_read_is_named(self):
        path = self.write(safetensors_bytes({"t": {"dtype": "U8", "shape": [64], "data_offsets": [0, 64]}},
                                            bytes(range(64))))
        real = os.preadv

        def short(fd, bufs, offset):
            # The header reads whole; the tensor's bytes meet an end of file half-way.
            if offset >= 8 + 64:
                return 0
            return real(fd, bufs, offset)

        with mock.patch.object(_read.os, "preadv", short):
            with self.assertRaisesRegex(er.FormatError, r"t.safetensors: ended at byte \d+, its header says \d+"):
                with _read.TensorFile(path) as f:
                    f.read({"t": self.torch.empty(64, dtype=self.torch.uint8)})

    def test_named_tensors_are_read_in_threads_and_the_rest_into_tensors_of_their_own(self):
        torch = self.torch
        from safetensors.torch import save_file

        tensors = {f"t{i}": torch.randn(1000 + 37 * i) for i in range(40)}
        path = os.path.join(self.tmp.name, "many.safetensors")
        save_file(tensors, path)
        with open(path, "rb") as f:
            before = f.read()
        into = {f"t{i}": torch.empty(1000 + 37 * i) for i in range(0, 40, 2)}
        with mock.patch.object(_read, "_PARALLEL_BYTES_MIN", 0), \
                mock.patch.object(_read, "ThreadPoolExecutor", wraps=_read.ThreadPoolExecutor) as pool:
            with _read.TensorFile(path) as f:
                got = f.read(into)
        self.assertEqual(pool.call_count, 1)
        for k, t in tensors.items():
            self.assertTrue(torch.equal(got[k], t), k)
            if k in into:
                self.assertIs(got[k], into[k])
        # The others are tensors of their own: the file is not mapped (a mapping would keep
        # all of it in memory while any of them lives), and writes stay in this process.
        self.assertNotIn(path, tc.mapped_files())
        got["t1"].add_(1)
        got["t3"].zero_()
        with open(path, "rb") as f:
            self.assertEqual(f.read(), before)
        self.assertTrue(torch.equal(got["t1"], tensors["t1"] + 1))

    def test_bytes_not_aligned_to_their_dtype_are_copied(self):
        torch = self.torch
        # A 3-byte bool tensor first puts the float32 one at data offset 3.
        header = {"b": {"dtype": "BOOL", "shape": [3], "data_offsets": [0, 3]},
                  "f": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]}}
        h = json.dumps(header).encode()
        h += b" " * (-len(h) % 8)
        data = bytes([1, 0, 1]) + struct.pack("<2f", 1.5, -2.0)
        path = self.write(struct.pack("<Q", len(h)) + h + data)
        with _read.TensorFile(path) as f:
            got = f.read()
        self.assertEqual(got["f"].tolist(), [1.5, -2.0])
        self.assertEqual(got["f"].data_ptr() % 4, 0)
        self.assertEqual(got["b"].tolist(), [True, False, True])


class InPlace(tc.Restores):
    """A restore loads a module's tensors by reading the file into them: the parameters keep
    their memory, and no second copy is made; a checkpoint that does not fit reads into nothing."""

    def reads(self):
        """Patches TensorFile.read to record the tensors each call read into."""
        calls = []
        real = _read.TensorFile.read

        def read(f, into=None):
            calls.append(dict(into or {}))
            return real(f, into)

        return calls, mock.patch.object(_read.TensorFile, "read", read)

    def restored(self):
        """A step saved by a world of 2, restored for rank 0 of 1 as the agent lays it out, and
        the environment set to load it: the model, optimizer and restore directory."""
        model, opt, staged = self.stage()
        out = self.restore(staged, world=1)
        self.env(ELASTIC_RESUME_DIR=out, ELASTIC_RESUME_STEP=7, RANK=0, WORLD_SIZE=1)
        return model, opt, out

    def test_the_model_form_reads_into_the_parameters(self):
        torch = self.torch
        model, opt, out = self.restored()
        fresh, fresh_opt = self.make(1)
        ptrs = [p.data_ptr() for p in fresh.parameters()]
        state_ptrs = self.state_ptrs(fresh_opt)
        calls, patch = self.reads()
        with patch:
            step, _ = er.load(model=fresh, optimizer=fresh_opt)
        self.assertEqual(step, 7)
        self.assertEqual(len(calls), 1)
        # The optimizer has stepped: its own state tensors are read into as well.
        self.assertEqual(sorted(calls[0]), sorted([f"model/{k}" for k in fresh.state_dict()]
                                                  + [f"optim/state/{i}/{k}" for i, k in state_ptrs]))
        self.assertEqual([p.data_ptr() for p in fresh.parameters()], ptrs)
        self.assertEqual(self.state_ptrs(fresh_opt), state_ptrs)
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
            self.assertTrue(torch.equal(a, b))
        self.assertEqual(opt.state_dict()["state"].keys(), fresh_opt.state_dict()["state"].keys())
        for i, st in opt.state_dict()["state"].items():
            for k, v in st.items():
                self.assertTrue(torch.equal(v, fresh_opt.state_dict()["state"][i][k]), (i, k))

    @staticmethod
    def state_ptrs(opt):
        """``(parameter index, name) -> data_ptr`` of each tensor the optimizer holds as state."""
        sd = opt.state_dict()["state"]
        return {(i, k): v.data_ptr() for i, st in sd.items() for k, v in st.items() if v.numel()}

    def test_a_fresh_optimizer_gets_its_state_from_the_file_and_a_mismatched_one_is_not_read_into(self):
        torch = self.torch
        model, opt, out = self.restored()
        fresh, _ = self.make(1)
        # Without state yet: only the parameters are read into.
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
        calls, patch = self.reads()
        with patch:
            er.load(model=fresh, optimizer=fresh_opt)
        self.assertEqual(sorted(calls[0]), sorted(f"model/{k}" for k in fresh.state_dict()))
        # Its state is tensors of its own, not of the restored file, which the agent removes.
        self.assertFalse([p for p in tc.mapped_files() if p.startswith(out)])
        for i, st in opt.state_dict()["state"].items():
            for k, v in st.items():
                self.assertTrue(torch.equal(v, fresh_opt.state_dict()["state"][i][k]), (i, k))
        # Groups that do not pair with the saved ones: the optimizer's state is not written, and
        # loading it fails as load_state_dict fails.
        other, other_opt = self.make(2)
        split = torch.optim.Adam([{"params": list(other.parameters())[:2]},
                                  {"params": list(other.parameters())[2:]}], lr=0.01)
        split.load_state_dict(other_opt.state_dict() | {"param_groups": split.state_dict()["param_groups"]})
        before = {key: t.clone() for key, t in self.state_tensors(split).items()}
        calls, patch = self.reads()
        with patch, self.assertRaisesRegex(ValueError, "parameter groups"):
            er.load(model=other, optimizer=split)
        self.assertFalse([k for k in calls[0] if k.startswith("optim/")])
        for key, t in self.state_tensors(split).items():
            self.assertTrue(torch.equal(t, before[key]), key)

    @staticmethod
    def state_tensors(opt):
        return {(i, k): v for i, st in opt.state_dict()["state"].items() for k, v in st.items()}

    def test_the_state_form_reads_into_the_optimizers_own_state(self):
        torch = self.torch
        model, opt = self.make(0)
        out = self.stage_state({"model": model, "opt": opt})
        fresh, fresh_opt = self.make(1)
        ptrs = self.state_ptrs(fresh_opt)
        calls, patch = self.reads()
        with patch:
            self.assertEqual(er.load({"model": fresh, "opt": fresh_opt}, resume_dir=out), 7)
        self.assertEqual(len(calls[0]), len(fresh.state_dict()) + len(ptrs))
        self.assertEqual(self.state_ptrs(fresh_opt), ptrs)
        for i, st in opt.state_dict()["state"].items():
            for k, v in st.items():
                self.assertTrue(torch.equal(v, fresh_opt.state_dict()["state"][i][k]), (i, k))

    def test_two_optimizers_never_read_into_one_tensor(self):
        torch = self.torch

        def two(seed):
            torch.manual_seed(seed)
            a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
            oa, ob = torch.optim.Adam(a.parameters(), lr=0.01), torch.optim.Adam(b.parameters(), lr=0.01)
            for m, o in ((a, oa), (b, ob)):
                m(torch.randn(2, 4)).pow(2).sum().backward()
                o.step()
            return {"a": a, "b": b, "oa": oa, "ob": ob}

        saved = two(0)
        out = self.stage_state(saved)
        fresh = two(1)
        # The second optimizer's state for b.weight is the very tensor the first holds for
        # a.weight: one of the two is read into, and the other gets a tensor of its own.
        wa, wb = fresh["a"].weight, fresh["b"].weight
        fresh["ob"].state[wb]["exp_avg"] = fresh["oa"].state[wa]["exp_avg"]
        calls, patch = self.reads()
        with patch:
            self.assertEqual(er.load(fresh, resume_dir=out), 7)
        ptrs = [t.untyped_storage().data_ptr() for t in calls[0].values()]
        self.assertEqual(len(ptrs), len(set(ptrs)))
        for k in ("oa", "ob"):
            for i, st in saved[k].state_dict()["state"].items():
                for name, v in st.items():
                    self.assertTrue(torch.equal(v, fresh[k].state_dict()["state"][i][name]), (k, i, name))

    def stage_state(self, state, step=7):
        staging = os.path.join(self.tmp.name, "staging")
        self.env(ELASTIC_STAGING_DIR=staging, RANK=0, WORLD_SIZE=1)
        os.environ.pop("ELASTIC_AGENT_SOCKET", None)
        er.save(step, state)
        return self.restore(os.path.join(staging, f"step-{step}"), world=1, step=step)

    def test_the_state_form_reads_into_every_module_and_fills_the_rest(self):
        torch = self.torch
        model, opt = self.make(0)
        ema = torch.nn.Linear(8, 16)
        out = self.stage_state({"model": model, "ema": ema, "opt": opt, "extra": {"x": torch.arange(4)}})
        fresh, fresh_opt = self.make(1)
        fresh_ema = torch.nn.Linear(8, 16)
        ptrs = [p.data_ptr() for p in list(fresh.parameters()) + list(fresh_ema.parameters())]
        state = {"model": fresh, "ema": fresh_ema, "opt": fresh_opt, "extra": None}
        calls, patch = self.reads()
        with patch:
            self.assertEqual(er.load(state, resume_dir=out), 7)
        self.assertEqual(len(calls), 1)
        self.assertEqual(len(calls[0]), len(fresh.state_dict()) + len(fresh_ema.state_dict())
                         + len(self.state_ptrs(fresh_opt)))
        self.assertEqual([p.data_ptr() for p in list(fresh.parameters()) + list(fresh_ema.parameters())], ptrs)
        for a, b in ((model, fresh), (ema, fresh_ema)):
            for x, y in zip(a.state_dict().values(), b.state_dict().values()):
                self.assertTrue(torch.equal(x, y))
        self.assertTrue(torch.equal(state["extra"]["x"], torch.arange(4)))

    def test_a_checkpoint_that_does_not_fit_reads_into_nothing_and_loads_nothing(self):
        torch = self.torch
        model, _ = self.make(0)
        out = self.stage_state({"model": model, "head": torch.nn.Linear(4, 2)})
        # The model fits exactly and the head does not: nothing may be read into the model.
        other, _ = self.make(2)
        before = [t.clone() for t in other.state_dict().values()]
        calls, patch = self.reads()
        with patch, self.assertRaisesRegex(er.StateError, r"state\[.head.\]\[.weight.\].*the state has float32 \[3, 4\]"):
            er.load({"model": other, "head": torch.nn.Linear(4, 3)}, resume_dir=out)
        self.assertEqual(calls, [])
        for a, b in zip(before, other.state_dict().values()):
            self.assertTrue(torch.equal(a, b))

    def test_a_module_of_another_dtype_reads_into_nothing(self):
        torch = self.torch
        model, opt = self.make(0)
        out = self.stage_state({"model": model})
        other = self.make(1)[0].to(torch.float64)
        before = [t.clone() for t in other.state_dict().values()]
        calls, patch = self.reads()
        with patch, self.assertRaisesRegex(er.StateError, r"state\['model'\]\['0.weight'\].*float32"):
            er.load({"model": other}, resume_dir=out)
        self.assertEqual(calls, [])
        for a, b in zip(before, other.state_dict().values()):
            self.assertTrue(torch.equal(a, b))
