"""The examples `onedoor demo` prints work as printed: each is cut out of the printed text and run
with bash, with ONEDOOR_URL and ONEDOOR_KEY exported as the printed `export` lines say and the
test venv first on PATH (so `python3` has `openai`, as after `pip install openai`)."""

import json
import os
import re
import subprocess
import sys

import pytest

CURL_COMMAND = re.compile(r"curl\s+-")
PY_BLOCK = re.compile(r"^python3 - <<'PY'\n.*?^PY$", re.M | re.S)


def curl_lines(text: str) -> list[str]:
    """Command lines only: `curl -...`, not prose that starts with the word (`curl (the gateway's ...`)."""
    return [line.strip() for line in text.splitlines() if CURL_COMMAND.match(line.strip())]


def python_blocks(text: str) -> list[str]:
    return [m.group(0) + "\n" for m in PY_BLOCK.finditer(text)]


def run(demo, script: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["ONEDOOR_URL"] = demo.url
    env["ONEDOOR_KEY"] = demo.key
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)


def check_all(demo, scripts: list[str], check) -> None:
    """Runs every script and reports every failure at once, not just the first."""
    failures = []
    for script in scripts:
        done = run(demo, script)
        problem = None
        if done.returncode != 0:
            problem = f"exit code {done.returncode}"
        elif not done.stdout.strip():
            problem = "no output"
        else:
            problem = check(script, done.stdout)
        if problem:
            failures.append(f"$ {script}\n  -> {problem}\n--- stdout ---\n{done.stdout}\n--- stderr ---\n{done.stderr}")
    assert not failures, "\n\n".join(failures)


def test_the_demo_prints_its_examples(demo):
    assert len(curl_lines(demo.text)) >= 4, demo.text
    assert len(python_blocks(demo.text)) >= 2, demo.text
    assert "$ONEDOOR_URL" in demo.text and "$ONEDOOR_KEY" in demo.text


def test_curl_examples_work_as_printed(demo):
    def check(line: str, out: str):
        if " -si " in f" {line} " and "/chat/completions" in line:
            status = out.splitlines()[0] if out else ""
            if not status.startswith("HTTP/1.1 200"):
                return f"status line {status!r}, wanted HTTP/1.1 200"
        if '"stream":true' in line:
            # A stream ends with [DONE], or (cut upstream, contract rule 4) an explicit error event; never silently.
            events = [ln[len("data:"):].strip() for ln in out.splitlines() if ln.startswith("data:")]
            last = events[-1] if events else ""
            if last != "[DONE]" and '"error"' not in last:
                return f"the stream ended neither with data: [DONE] nor with an error event (last event {last!r})"
        if "/admin/" in line:
            try:
                json.loads(out)
            except ValueError as error:
                return f"the admin answer is not JSON: {error}"
        return None

    check_all(demo, curl_lines(demo.text), check)


def test_python_examples_work_as_printed(demo):
    check_all(demo, python_blocks(demo.text), lambda _script, _out: None)


@pytest.mark.parametrize("kind", ["curl", "python"])
def test_examples_use_the_exported_variables_not_literals(demo, kind):
    """Pasted into another shell, the examples must still work: they name $ONEDOOR_URL/$ONEDOOR_KEY
    (or os.environ) rather than this run's URL and key (the admin line is the one exception)."""
    scripts = curl_lines(demo.text) if kind == "curl" else python_blocks(demo.text)
    literal = [s for s in scripts if demo.key in s or (demo.url in s and "/admin/" not in s)]
    assert not literal, literal
