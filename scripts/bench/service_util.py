"""Starting and stopping an OPD service process for the benchmarks (shared by teacher.py and
rollout.py). The service listens on an ephemeral loopback port, reports it through a port file,
and is stopped (SIGTERM, then SIGKILL) when the `with` block ends, also on error."""
import contextlib
import os
import secrets
import signal
import subprocess
import tempfile
import time


@contextlib.contextmanager
def running_service(binary, args, secret):
    with tempfile.TemporaryDirectory(prefix="opd_bench_") as tmp:
        port_file = os.path.join(tmp, "port")
        log_path = os.path.join(tmp, "log")
        env = dict(os.environ, OPD_SECRET=secret)
        with open(log_path, "w") as log:
            proc = subprocess.Popen([binary, *args, "--listen=127.0.0.1:0", f"--port-file={port_file}"],
                                    stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.time() + 300
            while not os.path.exists(port_file):
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"{binary} did not start:\n" + open(log_path).read())
                time.sleep(0.05)
            time.sleep(0.2)  # the port file is written once the server is up
            yield "127.0.0.1:" + open(port_file).read().strip()
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def new_secret():
    return secrets.token_hex(16)
