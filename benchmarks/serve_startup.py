"""Time from launching `conveyor serve` to the first successful completion, then stop it with SIGINT.

    .venv/bin/python -m benchmarks.serve_startup [--model smollm2] [--port 8000]
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    conveyor = Path(sys.executable).with_name("conveyor")
    url = f"http://127.0.0.1:{args.port}/v1/chat/completions"
    body = {"model": args.model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16, "temperature": 0}
    start = time.monotonic()
    proc = subprocess.Popen([str(conveyor), "serve", "--model", args.model, "--port", str(args.port)],
                            env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    try:
        while time.monotonic() - start < args.timeout:
            if proc.poll() is not None:
                print(f"conveyor serve exited with {proc.returncode}")
                return 1
            try:
                resp = httpx.post(url, json=body, timeout=30)
                if resp.status_code == 200:
                    ready = time.monotonic() - start
                    answer = resp.json()["choices"][0]["message"]["content"]
                    print(f"first completion after {ready:.1f}s: {answer!r}")
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            print("timed out")
            return 1
    finally:
        stop = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
        print(f"shut down in {time.monotonic() - stop:.1f}s (exit {code})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
