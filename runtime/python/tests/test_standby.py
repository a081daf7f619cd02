"""The warm standby (``elastic_run/_standby.py``, run as ``python -u -c`` by the agent): it
waits on its stdin socket, then runs the script or module it is handed as a fresh
``python -u`` would, with the environment and output streams it was given.

python -m unittest discover -s runtime/python/tests -t runtime/python -k Standby"""

import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import unittest

SOURCE = os.path.join(os.path.dirname(__file__), "..", "elastic_run", "_standby.py")

PROBE = r"""
import json, os, sys
print(json.dumps({"argv": sys.argv, "name": __name__, "path0": sys.path[0],
                  "keep": os.environ.get("KEEP"), "gone": os.environ.get("GONE"),
                  "new": os.environ.get("NEW"), "torch": "torch" in sys.modules}))
print("to stderr", file=sys.stderr)
sys.exit(int(os.environ.get("EXIT", "0")))
"""


class Standby(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.dir = self.tmp.name
        with open(SOURCE) as f:
            self.source = f.read()

    def start(self):
        agent, child = socket.socketpair()
        env = dict(os.environ, KEEP="1", GONE="x")
        p = subprocess.Popen([sys.executable, "-u", "-c", self.source], stdin=child.fileno(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        child.close()
        self.addCleanup(self.end, p)
        return agent, p

    @staticmethod
    def end(p):
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stderr.close()

    def activate(self, agent, argv, env, unset, body=None):
        out = open(os.path.join(self.dir, "out"), "wb")
        err = open(os.path.join(self.dir, "err"), "wb")
        if body is None:
            body = json.dumps({"argv": argv, "env": env, "unset": unset}).encode()
        msg = struct.pack(">I", len(body)) + body
        socket.send_fds(agent, [msg[:3]], [out.fileno(), err.fileno()])
        agent.sendall(msg[3:])
        out.close()
        err.close()
        agent.close()

    def output(self, name):
        with open(os.path.join(self.dir, name)) as f:
            return f.read()

    def test_a_script_runs_as_python_would_with_the_new_environment_and_streams(self):
        script = os.path.join(self.dir, "sub", "train.py")
        os.makedirs(os.path.dirname(script))
        with open(script, "w") as f:
            f.write(PROBE)
        agent, p = self.start()
        self.activate(agent, [script, "--lr", "1"], {"NEW": "2", "EXIT": "3"}, ["GONE"])
        self.assertEqual(p.wait(120), 3, p.stderr.read().decode())
        got = json.loads(self.output("out").splitlines()[0])
        self.assertEqual(got["argv"], [script, "--lr", "1"])
        self.assertEqual(got["name"], "__main__")
        self.assertEqual(got["path0"], os.path.dirname(os.path.realpath(script)))
        self.assertEqual((got["keep"], got["gone"], got["new"]), ("1", None, "2"))
        self.assertTrue(got["torch"], "torch was imported before the script started")
        self.assertEqual(self.output("err"), "to stderr\n")

    def test_a_module_runs_as_python_dash_m_would(self):
        pkg = os.path.join(self.dir, "pkg")
        os.makedirs(pkg)
        open(os.path.join(pkg, "__init__.py"), "w").close()
        with open(os.path.join(pkg, "train.py"), "w") as f:
            f.write(PROBE)
        agent, p = self.start_in(self.dir)
        self.activate(agent, ["-m", "pkg.train", "x"], {}, [])
        self.assertEqual(p.wait(120), 0, p.stderr.read().decode())
        got = json.loads(self.output("out").splitlines()[0])
        self.assertEqual(got["argv"], [os.path.join(self.dir, "pkg", "train.py"), "x"])
        self.assertEqual(got["name"], "__main__")
        self.assertEqual(got["path0"], self.dir)

    def start_in(self, cwd):
        agent, child = socket.socketpair()
        p = subprocess.Popen([sys.executable, "-u", "-c", self.source], stdin=child.fileno(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=cwd)
        child.close()
        self.addCleanup(self.end, p)
        return agent, p

    def test_let_go_without_a_message_it_exits_0(self):
        agent, p = self.start()
        agent.close()
        self.assertEqual(p.wait(120), 0)

    def test_a_bad_message_is_an_error_naming_it(self):
        for body, why in [(b"{not json", "Expecting"),
                          (json.dumps({"argv": [], "env": {}, "unset": []}).encode(), "argv"),
                          (json.dumps({"argv": ["-m"], "env": {}, "unset": []}).encode(), "-m without"),
                          (json.dumps({"argv": ["x"], "env": {"A": 1}, "unset": []}).encode(), "env")]:
            agent, p = self.start()
            self.activate(agent, None, None, None, body=body)
            self.assertEqual(p.wait(120), 70)
            self.assertIn(why, p.stderr.read().decode())
        agent, p = self.start()
        agent.sendall(struct.pack(">I", (1 << 20) + 1))
        agent.close()
        self.assertEqual(p.wait(120), 70)
        self.assertIn("at most", p.stderr.read().decode())


if __name__ == "__main__":
    unittest.main()
