"""`opd report`: one self-contained HTML page per run, rendered for real in headless Chromium
(Debian's `chromium`): a screenshot that is not blank, and no console errors, exceptions, failed
loads or blocked (network) requests.

The browser is driven over the DevTools protocol through `--remote-debugging-pipe` (file
descriptors 3 and 4, NUL-terminated JSON): standard library only, no port, no websocket package.
"""
from __future__ import annotations

import base64
import html
import io
import json
import os
import re
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from stages.run import runview
from support import ROOT, TINY, opd

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (Debian package "
                                    "`chromium`; ./install.sh test installs it when run as root)")


class Browser:
    """A headless Chromium driven over the DevTools protocol on a pipe."""

    def __init__(self, profile: Path, timeout: float = 60.0):
        self.timeout = timeout
        to_chrome_r, self._w = os.pipe()
        self._r, from_chrome_w = os.pipe()
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-default-apps", "--disable-extensions", "--disable-dev-shm-usage", "--mute-audio", "--hide-scrollbars",
                 f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank"]
        # Chromium reads commands on fd 3 and writes replies on fd 4
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$0" "$@" 3<&{to_chrome_r} 4>&{from_chrome_w}', CHROMIUM, *flags],
            pass_fds=(to_chrome_r, from_chrome_w), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf, self._id, self.events = b"", 0, []

    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._r], [], [], left)[0]:
                raise TimeoutError("no answer from chromium over the DevTools pipe")
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                raise RuntimeError(f"chromium exited: {self.proc.stderr.read().decode(errors='replace')[-2000:]}")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            m = self._read_message(deadline)
            if m.get("id") == self._id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            self.events.append(m)

    def wait_event(self, method: str) -> dict:
        deadline = time.monotonic() + self.timeout
        while True:
            for e in self.events:
                if e.get("method") == method:
                    return e
            self.events.append(self._read_message(deadline))

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._w)
        os.close(self._r)


def render_in_chromium(page: Path, profile: Path, width: int = 1280, height: int = 900) -> dict:
    """Load `page`, return {"png": full-page screenshot bytes, "problems": [...], "dom": {...}}."""
    b = Browser(profile)
    try:
        target = b.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        sid = b.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            b.send(f"{domain}.enable", session=sid)
        b.send("Emulation.setDeviceMetricsOverride",
               {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, session=sid)
        b.send("Page.navigate", {"url": page.resolve().as_uri()}, session=sid)
        b.wait_event("Page.loadEventFired")
        dom = b.send("Runtime.evaluate", {"returnByValue": True, "expression": """({
            images: document.images.length,
            broken: [...document.images].filter(i => !i.complete || i.naturalWidth === 0).map(i => i.alt),
            headings: [...document.querySelectorAll('h2')].map(h => h.textContent),
            tokens: document.querySelectorAll('.resp .tok').length,
            first_line: document.body.innerText.trim().split('\\n')[0],
            height: document.documentElement.scrollHeight})"""}, session=sid)["result"]["value"]
        shot = b.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}, session=sid)
        problems = []
        for e in b.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                problems.append(f"console.{p['type']}: {[a.get('value', a.get('description')) for a in p['args']]}")
            elif m == "Runtime.exceptionThrown":
                problems.append(f"exception: {p['exceptionDetails'].get('text')}")
            elif m == "Log.entryAdded" and p["entry"]["level"] == "error":
                problems.append(f"log {p['entry']['level']} ({p['entry']['source']}): {p['entry']['text']}")
        return {"png": base64.b64decode(shot["data"]), "problems": problems, "dom": dom}
    finally:
        b.close()


def blankness(png: bytes) -> dict:
    """How much of a screenshot is not page background."""
    from PIL import Image

    img = Image.open(io.BytesIO(png)).convert("RGB")
    small = img.resize((img.width // 4, img.height // 4))
    px = list(small.get_flattened_data())  # (getdata: deprecated in the locked Pillow 13)
    non_white = sum(1 for r, g, b in px if min(r, g, b) < 235)
    return {"size": img.size, "colors": len(set(px)), "non_white": non_white / len(px)}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, seeded_store) -> Path:
    """A tiny run through train and evaluate (no export: the report does not read it)."""
    d = tmp_path_factory.mktemp("report")
    (d / "conf").symlink_to(ROOT / "conf")
    for part in ("tokenizer", "model"):
        shutil.copytree(seeded_store / part, d / "artifacts" / "store" / part)
    opd("stage", "train", *TINY, cwd=d)
    opd("stage", "evaluate", *TINY, cwd=d)
    return d


def test_report_is_one_self_contained_file(finished_run, tmp_path):
    r = opd("report", "default", "--out", str(tmp_path / "r.html"), cwd=finished_run)
    assert "report:" in r.stdout
    page = (tmp_path / "r.html").read_text()
    # nothing is fetched: no external URL in any src/href, no script; the CSP forbids every fetch
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//|file:)""", page)
    assert "<script" not in page and "default-src 'none'" in page
    imgs = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(imgs) >= 5  # loss/KL, grad norm, throughput, wall time, memory, top-k mass
    assert all(base64.b64decode(x)[:8] == b"\x89PNG\r\n\x1a\n" for x in imgs)
    for section in ("Config", "Training curves", "Time and memory per phase", "Trajectories", "Evaluation"):
        assert section in page
    run = finished_run / "artifacts" / "runs" / "default"
    metrics = json.loads((run / "metrics.json").read_text())
    assert f"{metrics['kl_after']:.4g}" in page  # evaluation results
    assert "arch:tiny-llama-teacher" in page and "forward_kl_topk" in page  # config summary
    assert page.count('class="tok"') > 10  # token-level gap colouring
    # a run dir works as well as a run name
    opd("report", str(run), "--out", str(tmp_path / "by-path.html"), cwd=finished_run)
    assert (tmp_path / "by-path.html").stat().st_size > 10_000
    # the default output goes into the run view; the same inputs give the same bytes
    opd("report", "default", cwd=finished_run)
    assert (run / "report.html").read_bytes() == (tmp_path / "r.html").read_bytes()


def test_report_of_a_missing_run_is_a_one_line_error(finished_run):
    r = opd("report", "nope", cwd=finished_run, check=False)
    assert r.returncode == 2 and "run 'nope'" in r.stderr and "default" in r.stderr
    assert "Traceback" not in r.stderr


def test_report_of_a_partial_run(finished_run, tmp_path):
    """A run view with steps but no evaluation yet still renders (what a user has mid-training)."""
    part = tmp_path / "partial"
    shutil.copytree(finished_run / "artifacts" / "runs" / "default", part, symlinks=True)
    (part / "metrics.json").unlink()
    (part / "eval.json").unlink()
    # the links are relative to the run view's place in artifacts/: repoint them at the store
    for link in list(part.glob("step-*/*")):
        if link.is_symlink():
            target = (finished_run / "artifacts" / "runs" / "default" / link.relative_to(part)).resolve()
            link.unlink()
            link.symlink_to(target)
    out = tmp_path / "p.html"
    opd("report", str(part), "--out", str(out), cwd=finished_run)
    page = out.read_text()
    assert "No eval.json yet" in page and page.count("data:image/png") >= 5


@needs_chromium
def test_report_renders_in_headless_chromium(finished_run, tmp_path):
    out = tmp_path / "report.html"
    opd("report", "default", "--out", str(out), cwd=finished_run)
    res = render_in_chromium(out, tmp_path / "profile")
    shot = tmp_path / "report.png"
    shot.write_bytes(res["png"])
    assert res["problems"] == [], res["problems"]
    dom = res["dom"]
    assert dom["images"] >= 5 and dom["broken"] == [], dom
    assert dom["headings"] == ["Config", "Training curves", "Time and memory per phase", "Trajectories",
                               "Evaluation (held-out)"]
    assert dom["tokens"] > 10
    # what a reader sees first: the warning of a run that got worse, else the title
    metrics = json.loads((finished_run / "artifacts" / "runs" / "default" / "metrics.json").read_text())
    assert dom["first_line"] == (runview.worse_warning(metrics) or "opd report: default"), dom["first_line"]
    stats = blankness(res["png"])
    assert stats["size"][1] >= 900  # the full page, not just the viewport
    assert stats["colors"] > 50 and stats["non_white"] > 0.03, stats


@needs_chromium
def test_browser_check_catches_a_console_error_and_a_blocked_fetch(tmp_path):
    """The check above can fail: a page that logs an error and tries the network is reported."""
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><head><meta http-equiv=\"Content-Security-Policy\" "
                   "content=\"default-src 'none'; script-src 'unsafe-inline'\"></head><body><p>x</p>"
                   "<img src=\"http://127.0.0.1:9/x.png\" alt=\"remote\">"
                   "<script>console.error('boom')</script></body></html>")
    res = render_in_chromium(bad, tmp_path / "profile")
    text = "\n".join(res["problems"])
    assert "boom" in text and "127.0.0.1:9" in text
    assert res["dom"]["broken"] == ["remote"]


def test_eval_section_shows_answers_side_by_side_and_marks_blank_ones():
    from stages.report_html import eval_section

    record = {"initial": {"on_teacher_text": {"kl": 3.1, "top1_agreement": 0.28, "tokens": 9},
                          "answers": {"nonblank": 0.5, "distinct_bigrams": 0.4, "mean_tokens": 3.0}},
              "final": {"on_teacher_text": {"kl": 0.8, "top1_agreement": 0.62, "tokens": 9},
                        "answers": {"nonblank": 1.0, "distinct_bigrams": 0.5, "mean_tokens": 4.0}},
              "teacher": {"answers": {"nonblank": 1.0, "distinct_bigrams": 0.6, "mean_tokens": 5.0}},
              "updates": 2}  # the run view's eval.json
    answers = {"side_by_side": [{"prompt": "What is 2 plus 2?", "teacher": "2 + 2 = 4", "initial": "\n\n",
                                 "final": "<b>4</b>"}]}
    page = eval_section(record, answers)
    assert "(blank)" in page and "2 + 2 = 4" in page and "&lt;b&gt;4&lt;/b&gt;" in page  # escaped, not markup
    assert "50.0%" in page and "100.0%" in page  # non-blank shares of the initial and final answers
    assert "initial.answers" not in page and "updates" in page  # shown once
    # a view written before eval.json kept the record in metrics.json, under `eval`: the same tables
    old = eval_section({"eval": {k: v for k, v in record.items() if k != "updates"}, "updates": 2}, answers)
    assert old == page and "eval.updates" not in old


def _first_visible_line(page: str) -> str:
    body = re.sub(r"<[^>]+>", "\n", page.split("<body>", 1)[1])
    return next(html.unescape(line.strip()) for line in body.splitlines() if line.strip())


@pytest.mark.parametrize("worse", [True, False])
def test_the_reports_first_line_says_when_the_run_got_worse(tmp_path, worse):
    """The page's first visible text is the evaluate stage's warning for a run that left the student
    worse than policy 0 (metrics.json's `worse`), and the title otherwise."""
    from stages import report

    run = tmp_path / "runs" / "w"
    kl, agree = ((0.44, 1.14), (0.733, 0.588)) if worse else ((3.1, 0.75), (0.28, 0.65))
    metrics = {"kl_before": kl[0], "kl_after": kl[1], "agree_before": agree[0], "agree_after": agree[1],
               "nonblank_after": 1.0, "updates": 4, "worse": worse}
    run.mkdir(parents=True)
    (run / "metrics.json").write_text(json.dumps(metrics))
    page = report.render(run)
    want = ("warning: the trained student is worse than policy 0 on held-out prompts: KL 0.4400 -> 1.1400, "
            "agreement 0.733 -> 0.588 (consider a lower optim.lr)") if worse else "opd report: w"
    assert _first_visible_line(page) == want
    assert page.count("warning:") == int(worse)


def test_a_tiny_run_warns_exactly_when_it_got_worse(finished_run):
    """End to end: metrics.json's flat figures, `worse` as they say, the stage's one stderr line (also
    when the evaluation is reused) and the report's first line agree. (The tiny random pair's KL moves
    by a fraction of a percent, within the evaluation's noise: no warning; both paths are forced above.)"""
    run = finished_run / "artifacts" / "runs" / "default"
    m = json.loads((run / "metrics.json").read_text())
    ev = json.loads((run / "eval.json").read_text())
    assert m == runview.headline(ev, 3)
    assert m["worse"] == runview.worse(ev["initial"], ev["final"])
    r = opd("stage", "evaluate", *TINY, cwd=finished_run)
    assert "(published by an earlier run: reused)" in r.stdout
    warned = [line for line in r.stderr.splitlines() if line.startswith("warning: the trained student")]
    assert warned == ([runview.worse_warning(m)] if m["worse"] else [])
    opd("report", "default", "--out", str(finished_run / "first-line.html"), cwd=finished_run)
    first = _first_visible_line((finished_run / "first-line.html").read_text())
    assert first == (runview.worse_warning(m) or "opd report: default")
