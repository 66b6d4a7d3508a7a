#!/usr/bin/env python3
"""The README, run as a newcomer runs it, in a runtime-only install.

Copies the working tree (tracked and untracked files, not ignored ones such as .venv)
into a temporary folder, runs `make install` there (the runtime dependencies only: no
test extras) with its own empty caches (HOME, XDG_CACHE_HOME, pip's, HF's and jaxserve's
all point into the temporary folder), then runs the examples *as the README writes them*:

- every `.venv/bin/jaxserve generate ...` line of a ```bash block;
- every ```python block that builds an `LLM(`;
- `make serve`, then every `curl localhost:8000/...` command of a ```bash block
  (continuation lines joined), checking each answer's shape: a chat answer has text,
  a `response_format` json_schema answer parses and has the schema's required keys,
  a `tools` answer calls the named function with the required arguments.

A dependency that only the test extras bring (jinja2 once was one) fails here.
Standard library only: it runs under the system python3 before any venv exists.
Usage: python3 .ci/readme_smoke.py [--keep]
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PORT = 8000
SERVER_START_TIMEOUT_S = 900
STEP_TIMEOUT_S = 900


def log(msg: str) -> None:
    print(f"[readme-smoke {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def fail(msg: str) -> None:
    print(f"[readme-smoke] FAILED: {msg}", flush=True)
    sys.exit(1)


def fenced_blocks(text: str, lang: str) -> list[str]:
    """The bodies of the ```lang blocks, dedented (a block may sit inside a list item)."""
    return [textwrap.dedent(body) for _, body in
            re.findall(rf"^([ \t]*)```{lang}\n(.*?)^\1```", text, flags=re.S | re.M)]


def bash_commands(block: str) -> list[str]:
    """The block's commands: continuation lines and multi-line quoted strings joined,
    comment and blank lines between commands dropped."""
    commands, current = [], ""
    for line in block.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        current += line + "\n"
        try:
            shlex.split(current)
        except ValueError:  # a quote still open: the command goes on
            continue
        commands.append(current.strip())
        current = ""
    return commands


def request_body(cmd: str) -> dict:
    args = shlex.split(cmd)
    for flag in ("-d", "--data", "--data-raw"):
        if flag in args:
            return json.loads(args[args.index(flag) + 1])
    return {}


def copy_tree(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           check=True, capture_output=True).stdout.split(b"\0")
    for name in filter(None, files):
        src = REPO / name.decode()
        if not src.is_file():  # deleted in the working tree
            continue
        dst = dest / name.decode()
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(src.read_bytes())
        dst.chmod(src.stat().st_mode)


def run(cmd: str, cwd: Path, env: dict, timeout: float = STEP_TIMEOUT_S) -> str:
    log(f"$ {cmd}")
    t0 = time.monotonic()
    p = subprocess.run(cmd, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        fail(f"`{cmd}` exited {p.returncode}\n--- stdout ---\n{p.stdout[-4000:]}\n--- stderr ---\n{p.stderr[-6000:]}")
    log(f"  ok in {time.monotonic() - t0:.1f} s")
    return p.stdout


def check_chat_answer(cmd: str, body: dict) -> str:
    """The shape a chat / completion answer must have for the request `cmd` sent."""
    if "choices" not in body or not body["choices"]:
        fail(f"no choices in the answer to `{cmd}`: {body}")
    choice = body["choices"][0]
    request = request_body(cmd)
    message = choice.get("message")
    if message is None:  # /v1/completions
        if not choice.get("text", "").strip():
            fail(f"empty completion for `{cmd}`: {body}")
        return choice["text"]
    if request.get("tools") and request.get("tool_choice") not in (None, "none", "auto"):
        calls = message.get("tool_calls") or []
        if not calls or choice.get("finish_reason") != "tool_calls":
            fail(f"no tool call for `{cmd}`: {body}")
        tools = {t["function"]["name"]: t["function"] for t in request["tools"]}
        for call in calls:
            fn = tools.get(call["function"]["name"])
            if fn is None:
                fail(f"a call to an unknown tool: {call}")
            args = json.loads(call["function"]["arguments"])
            missing = set(fn.get("parameters", {}).get("required", [])) - set(args)
            if missing:
                fail(f"tool call arguments {args} miss {sorted(missing)}")
        return json.dumps(calls)
    content = message.get("content") or ""
    if not content.strip():
        fail(f"empty content for `{cmd}`: {body}")
    fmt = request.get("response_format") or {}
    if fmt.get("type") in ("json_schema", "json_object"):
        try:
            value = json.loads(content)
        except json.JSONDecodeError as e:
            fail(f"response_format {fmt['type']} but the content is not JSON ({e}): {content!r}")
        schema = fmt.get("json_schema", {}).get("schema", {})
        missing = set(schema.get("required", [])) - set(value)
        if missing:
            fail(f"JSON content {value} misses the schema's required {sorted(missing)}")
        extra = set(value) - set(schema.get("properties", value))
        if schema.get("additionalProperties") is False and extra:
            fail(f"JSON content {value} has properties the schema forbids: {sorted(extra)}")
    return content


def wait_for_server(proc: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            fail(f"`make serve` exited {proc.returncode}\n{log_path.read_text()[-6000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    fail(f"the server did not answer within {SERVER_START_TIMEOUT_S} s\n{log_path.read_text()[-6000:]}")


def main() -> None:
    readme = (REPO / "README.md").read_text()
    bash = [c for b in fenced_blocks(readme, "bash") for c in bash_commands(b)]
    generate = [c for c in bash if c.startswith(".venv/bin/jaxserve generate")]
    curls = [c for c in bash if re.match(r"curl\s+(http://)?(localhost|127\.0\.0\.1):8000/", c)]
    python = [b for b in fenced_blocks(readme, "python") if "LLM(" in b]
    if not (generate and curls and python):
        fail(f"README lost its examples: {len(generate)} generate, {len(curls)} curl, {len(python)} LLM blocks")
    log(f"README: {len(generate)} generate command(s), {len(curls)} curl(s), {len(python)} LLM block(s)")

    tmp = Path(tempfile.mkdtemp(prefix="jaxserve-readme-"))
    tree, home = tmp / "jaxserve", tmp / "home"
    home.mkdir()
    copy_tree(tree)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "JAXSERVE_", "XDG_", "VIRTUAL_ENV", "PYTHONPATH", "TRANSFORMERS_"))}
    env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), PIP_CACHE_DIR=str(home / ".cache" / "pip"),
               HF_HOME=str(home / ".cache" / "huggingface"), PYTHONUNBUFFERED="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    server = None
    try:
        # The interpreter by path: a pyenv shim would look for its versions under the new HOME.
        run(f"make install PYTHON={shlex.quote(sys.executable)}", tree, env, timeout=1800)
        for cmd in generate:
            out = run(cmd, tree, env)
            if not out.strip():
                fail(f"`{cmd}` printed nothing")
            log(f"  -> {out.strip()[:200]!r}")
        for i, block in enumerate(python):
            script = tree / f"readme_example_{i}.py"
            script.write_text(block)
            out = run(f".venv/bin/python {script.name}", tree, env)
            if not out.strip():
                fail(f"the README's python example {i} printed nothing")
            log(f"  -> {out.strip()[:200]!r}")

        log("$ make serve")
        server_log = tmp / "serve.log"
        server = subprocess.Popen(["make", "serve"], cwd=tree, env=env, stdout=open(server_log, "w"),
                                  stderr=subprocess.STDOUT, start_new_session=True)
        t0 = time.monotonic()
        wait_for_server(server, server_log)
        log(f"  serving after {time.monotonic() - t0:.1f} s")
        for cmd in curls:
            out = run(f"{cmd} --silent --show-error --fail-with-body --max-time 600", tree, env)
            try:
                body = json.loads(out)
            except json.JSONDecodeError:
                fail(f"`{cmd}` answered with something other than JSON: {out[:1000]!r}")
            log(f"  -> {check_chat_answer(cmd, body)[:200]!r}")
    finally:
        if server is not None and server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
        if "--keep" not in sys.argv:
            subprocess.run(["rm", "-rf", str(tmp)])
    log("every README example ran")


if __name__ == "__main__":
    main()
