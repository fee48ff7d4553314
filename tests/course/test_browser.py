"""The lessons in JupyterLab, in a real browser, as a student meets them.

A real JupyterLab server (free loopback port, token) serves copies of the notebooks; Playwright
drives the system's chromium, one page for the module: each notebook is opened in that page and
closed after. For a solution notebook: Run All through the Run menu, then every code cell has run,
no cell has an error output, every figure is an image in the page, every progress bar is drawn and
full, and every widget that holds a slider or a dropdown and a figure redraws the figure when the
control moves. For the first unsolved lesson: its first check cell shows the exercise's failure
message.

The fast tier runs, of the lessons whose widgets a student moves (``WIDGETS``: sliders and
dropdowns, what only a browser can show), the widget cells and the cells they need
(``widget_cells``: lesson 08's without its 4-rank measurement), and the unsolved lesson; the
whole solutions, every cell of every lesson, already ran in the fast tier's shared execution. The
soak tier runs every solution whole here, each lesson without widgets asserted to draw no slider
or dropdown (so that ``WIDGETS``, read from the sources, misses none; progress bars are widgets
too, checked drawn and full). A screenshot of the
whole notebook goes to ``runs/browser/`` when a test fails, and for every notebook under
``--soak``.

Needs chromium (``apt-get install chromium``; another binary: ``MINIZERO_CHROMIUM=/path``) and
``pip install playwright`` (its own browser download is not used); skipped without them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from lessons import needed_by

ROOT = Path(__file__).resolve().parents[2]
STEMS = sorted(p.stem for p in (ROOT / "course").glob("[0-9][0-9]_*.py"))
SHOTS = ROOT / "runs" / "browser"
CHROMIUM = (
    os.environ.get("MINIZERO_CHROMIUM")
    or shutil.which("chromium")
    or shutil.which("chromium-browser")
)
HOW = (
    "to run the browser tests: `apt-get install chromium` (or set MINIZERO_CHROMIUM to a "
    "chromium binary) and `pip install playwright`"
)
try:
    from playwright.sync_api import Browser, Page, sync_playwright
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
except ImportError:  # pragma: no cover - depends on the machine
    pytest.skip(f"playwright is not installed; {HOW}", allow_module_level=True)
if not CHROMIUM:
    pytest.skip(f"no chromium found; {HOW}", allow_module_level=True)

pytestmark = [pytest.mark.browser, pytest.mark.slow]
# The lessons whose solutions draw widgets: a lab widget call in the source (calculator(),
# timeline_widget()); the soak tier checks that the others draw none.
WIDGETS = [
    s for s in STEMS
    if re.search(r"\blab\.(calculator|\w*widget)\(", (ROOT / "course" / f"{s}.py").read_text())
]  # fmt: skip
RUN_TIMEOUT = 540  # seconds for one notebook's Run All (about 70 s each on 2 busy cores)
WAIT = 180  # seconds for a step of the UI (a menu enabled, a first cell started, a save): the
# other xdist worker may be running a dozen ranks on the same cores

# JupyterLab user settings: no news or update pop-ups (there is no network), every cell in the
# page (no virtual scrolling, so the whole notebook can be read and photographed).
SETTINGS = {
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none", "scrollPastEnd": False},
}


# -- the server and the browser ------------------------------------------------------------------
class Lab:
    """A JupyterLab server on 127.0.0.1 serving ``root`` (copies: runs never touch the repo)."""

    def __init__(self, root: Path, tmp: Path):
        self.root, self.token = root, secrets.token_hex(16)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        for name, values in SETTINGS.items():
            path = tmp / "settings" / f"{name}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        env = dict(os.environ)
        env.update(
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
            JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"),
            JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"),
            JUPYTER_CONFIG_DIR=str(tmp / "config"),
            JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
            JUPYTER_DATA_DIR=str(tmp / "data"),  # no user kernelspec named python3 can interfere
        )
        env.pop("MINIZERO_WIDGETS", None)
        self.log = (tmp / "server.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
             f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
             f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={root}",
             "--ServerApp.allow_root=True", "--LabApp.news_url=None",
             "--LabApp.expose_app_in_browser=True"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.logpath = tmp / "server.log"
        deadline = time.monotonic() + 120
        while True:
            try:
                self.api("GET", "status")
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    pytest.fail("JupyterLab did not start:\n" + self.logpath.read_text()[-3000:])
                time.sleep(0.5)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}/{path}"

    def api(self, method: str, path: str):
        req = urllib.request.Request(
            self.url(f"api/{path}"),
            method=method,
            headers={"Authorization": f"token {self.token}"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def shutdown_kernels(self) -> None:
        for session in self.api("GET", "sessions"):
            self.api("DELETE", f"sessions/{session['id']}")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lab")
    root = tmp / "notebooks"
    for variant in ("solutions", "lessons"):
        shutil.copytree(ROOT / variant, root / variant)
    (root / "widgets").mkdir()
    for stem in WIDGETS:  # the fast tier's notebooks: each widget cell and what it needs
        nb = json.loads((ROOT / "solutions" / f"{stem}.ipynb").read_text())
        nb["cells"] = [nb["cells"][i] for i in widget_cells(nb["cells"])]
        (root / "widgets" / f"{stem}.ipynb").write_text(json.dumps(nb))
    server = Lab(root, tmp)
    yield server
    server.close()


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield b
        b.close()


@pytest.fixture(scope="module")
def page(browser: Browser, lab: Lab):
    """One JupyterLab page for the module (the app loads once), the file browser closed, as a
    student reading a lesson would have it; each test opens its notebook in it."""
    page = browser.new_page(viewport=VIEW)
    page.goto(lab.url(f"lab?token={lab.token}&reset"))
    page.wait_for_function(
        "() => window.jupyterapp && window.jupyterapp.started", timeout=WAIT * 1000
    )
    page.evaluate("() => window.jupyterapp.restored")
    page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current").click()
    yield page
    page.close()


# -- driving JupyterLab -----------------------------------------------------------------------
_CELLS = """() => [...document.querySelectorAll('.jp-NotebookPanel .jp-Notebook .jp-Cell')]
.map(c => {
  const outs = [...c.querySelectorAll(
    ':scope .jp-Cell-outputArea > .jp-OutputArea-child > .jp-OutputArea-output')];
  return {
    code: c.classList.contains('jp-CodeCell'),
    prompt: (c.querySelector('.jp-InputPrompt') || {}).textContent || '',
    images: outs.filter(o => o.classList.contains('jp-RenderedImage')).map(o => {
      const i = o.querySelector('img'); return i ? i.complete && i.naturalWidth > 0 : false; }),
    widgets: outs.filter(o => o.querySelector('.jupyter-widgets')).length,
    bars: [...c.querySelectorAll('.widget-hprogress .progress-bar')].map(b => b.className),
    text: outs.map(o => o.innerText).join('\\n'),
  };
})"""
_PROMPTS = """[...document.querySelectorAll('.jp-NotebookPanel .jp-CodeCell .jp-InputPrompt')]
    .map(e => e.textContent.trim())"""
_STARTED = f"() => {_PROMPTS}.some(t => t === '[*]:' || /^\\[\\d+\\]:$/.test(t))"
_DONE = f"""() => {{ const p = {_PROMPTS};
  return p.length > 0 && !p.includes('[*]:') && p.some(t => /^\\[\\d+\\]:$/.test(t)); }}"""


VIEW = {"width": 1400, "height": 1000}


@contextlib.contextmanager
def opened(page: Page, lab: Lab, rel: str, shot: str):
    """``rel`` open in ``page`` for the ``with`` block, its kernel idle; then closed unsaved and
    its kernel shut down. A screenshot named ``shot`` when the block fails (and under --soak,
    which the block takes itself)."""
    page.evaluate("p => window.jupyterapp.commands.execute('docmanager:open', {path: p})", rel)
    try:
        page.wait_for_selector(
            ".jp-NotebookPanel .jp-Notebook-ExecutionIndicator[data-status='idle']",
            timeout=WAIT * 1000,
        )
        page.locator(".jp-NotebookPanel .jp-Cell").first.click()  # the notebook is active
        yield
    except BaseException:
        with contextlib.suppress(Exception):  # what the page showed, for the report
            screenshot(page, f"{shot}-FAILED")
        raise
    finally:
        page.evaluate(_CLOSE)  # no "save changes?" dialog: the copy's edits are thrown away
        page.set_viewport_size(VIEW)
        lab.shutdown_kernels()


_CLOSE = """() => { for (const w of [...window.jupyterapp.shell.widgets('main')]) {
  if (w.context) { w.context.model.dirty = false; } w.dispose(); } }"""


def menu(page: Page, title: str, command: str) -> None:
    """Click ``title`` in the menu bar, then the item for ``command`` once it is enabled (it is
    not until the notebook is the active widget with its kernel connected)."""
    item = page.locator(f".lm-Menu-item[data-command='{command}']")
    deadline = time.monotonic() + WAIT
    while True:
        page.locator("#jp-MainMenu .lm-MenuBar-itemLabel", has_text=title).first.click()
        item.wait_for(timeout=10_000)
        if "lm-mod-disabled" not in (item.get_attribute("class") or ""):
            item.click()
            return
        page.keyboard.press("Escape")
        if time.monotonic() > deadline:
            pytest.fail(f"{title} > {command} stayed disabled for {WAIT} s")
        page.locator(".jp-NotebookPanel .jp-Cell").first.click()
        page.wait_for_timeout(1000)


def unrun(cells: list[dict]) -> list[int]:
    """The code cells (numbered among code cells) whose prompt shows no execution count."""
    code = [c for c in cells if c["code"]]
    return [i for i, c in enumerate(code) if not re.fullmatch(r"\[\d+\]:", c["prompt"])]


def start_all(page: Page) -> None:
    """Run > Run All Cells, until a cell is queued or has run. A click made while a long lesson is
    still laying out its formulas can be lost (no cell queued, none running): it is made again."""
    deadline = time.monotonic() + WAIT
    while True:
        menu(page, "Run", "runmenu:run-all")
        try:
            page.wait_for_function(_STARTED, timeout=30_000, polling=500)
            return
        except PlaywrightTimeout:
            if time.monotonic() > deadline:
                pytest.fail(f"Run > Run All Cells did not start any cell within {WAIT} s")
            print("Run > Run All Cells queued no cell within 30 s: clicked again")


def run_all(page: Page) -> list[dict]:
    """Run > Run All Cells; wait until no cell is queued or running; the cells as the page shows
    them (code cells' prompts, images, widgets, progress bars, output text).

    Under load JupyterLab sometimes starts two kernels for a notebook it opens and drops the
    first: the queue is lost with it, and the cells after the first stay unrun with no error.
    Such a run is made once more (and said); a cell that fails or kills its kernel every time
    fails the test as before."""
    for attempt in (1, 2):
        start_all(page)
        page.wait_for_function(_DONE, timeout=RUN_TIMEOUT * 1000, polling=500)
        page.wait_for_timeout(1000)  # outputs that follow the last reply, images decoding
        cells = page.evaluate(_CELLS)
        lost = unrun(cells)
        if attempt == 2 or not lost or any("Traceback" in c["text"] for c in cells if c["code"]):
            return cells
        print(f"code cells {lost} were not run and none failed: Run All once more")
    raise AssertionError("unreachable")


def save(page: Page, path: Path, ran: int) -> dict:
    """File > Save Notebook; the notebook as written to disk (``ran`` code cells run)."""
    menu(page, "File", "docmanager:save")
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        try:
            nb = json.loads(path.read_text())
        except ValueError:  # caught mid-write
            nb = {"cells": []}
        if sum(c.get("execution_count") is not None for c in nb["cells"]) >= ran:
            return nb
        time.sleep(0.5)
    pytest.fail(f"{path.name} was not saved with its outputs within {WAIT} s")


def screenshot(page: Page, name: str) -> Path:
    """The whole notebook in one image: the page made as tall as the notebook's content."""
    for _ in range(3):  # a taller page can lay out a little differently: measure again
        tall = page.evaluate(
            """() => {
              const o = document.querySelector('.jp-NotebookPanel .jp-WindowedPanel-outer');
              o.scrollTo(0, 0);
              return o.scrollHeight - o.clientHeight; }"""
        )
        height = page.viewport_size["height"]
        if tall <= 0 or height >= 30_000:
            break
        page.set_viewport_size({"width": 1400, "height": min(height + int(tall) + 40, 30_000)})
        page.wait_for_timeout(1000)
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    page.screenshot(path=str(path))
    return path


def interact(page: Page) -> tuple[int, list[str]]:
    """Move the control of every widget that shows a figure (a slider: three steps right; a
    dropdown: the next option); return how many there were and which did not redraw."""
    boxes = page.locator(
        ".jp-OutputArea-output .widget-box:has(> .widget-output img):has(.widget-slider, "
        ".widget-dropdown)"
    )
    stuck = []
    for k in range(boxes.count()):
        box = boxes.nth(k)
        img = box.locator(".widget-output img").first
        before = img.get_attribute("src")
        handle = box.locator(".widget-slider .noUi-handle")
        if handle.count():
            handle.first.focus()
            for _ in range(3):
                handle.first.press("ArrowRight")
            what = "slider " + box.locator(".widget-slider .widget-label").first.inner_text()
        else:
            select = box.locator(".widget-dropdown select").first
            select.select_option(index=1)
            what = "dropdown " + box.locator(".widget-dropdown .widget-label").first.inner_text()
        try:
            page.wait_for_function(
                "([el, src]) => { const i = el.querySelector('.widget-output img');"
                " return i && i.src !== src && i.complete && i.naturalWidth > 0; }",
                arg=[box.element_handle(), before],
                timeout=60_000,
            )
        except PlaywrightTimeout:
            stuck.append(what)
    return boxes.count(), stuck


def widget_cells(cells: list[dict]) -> list[int]:
    """A solution's cells that draw a widget a student moves, and every cell they need."""
    calls = re.compile(r"\blab\.(calculator|\w*widget)\(")
    return needed_by(cells, [i for i, c in enumerate(cells) if calls.search("".join(c["source"]))])


# -- the tests ----------------------------------------------------------------------------------
@pytest.mark.soak
@pytest.mark.timeout(RUN_TIMEOUT + 120)
@pytest.mark.parametrize("stem", STEMS)
def test_solution_runs_in_jupyterlab(lab: Lab, page: Page, stem: str, request):
    runs_in_jupyterlab(lab, page, "solutions", stem, request)


@pytest.mark.timeout(RUN_TIMEOUT + 120)
@pytest.mark.parametrize("stem", WIDGETS)
def test_widget_cells_run_in_jupyterlab(lab: Lab, page: Page, stem: str, request):
    """The fast tier: each widget lesson's widget cells and the cells they need (the whole
    solution ran in the shared execution; the soak tier runs it whole here too)."""
    runs_in_jupyterlab(lab, page, "widgets", stem, request)


def runs_in_jupyterlab(lab: Lab, page: Page, folder: str, stem: str, request) -> None:
    shot = stem if folder == "solutions" else f"{stem}-{folder}"
    with opened(page, lab, f"{folder}/{stem}.ipynb", shot):
        cells = run_all(page)
        code = [c for c in cells if c["code"]]
        unfinished = unrun(cells)
        assert not unfinished, f"code cells that did not finish: {unfinished}"
        nb = save(page, lab.root / folder / f"{stem}.ipynb", len(code))
        saved = [c for c in nb["cells"] if c["cell_type"] == "code"]
        assert len(saved) == len(code)
        widgets = 0
        for i, (shown, cell) in enumerate(zip(code, saved)):
            where = f"{stem}, code cell {i}:\n{''.join(cell['source'])[:300]}"
            errors = [o for o in cell["outputs"] if o["output_type"] == "error"]
            assert not errors, f"{where}\nerror output: {errors[0]['ename']}: {errors[0]['evalue']}"
            pngs = sum("image/png" in o.get("data", {}) for o in cell["outputs"])
            assert len(shown["images"]) == pngs and all(shown["images"]), (
                f"{where}\nimages saved: {pngs}, drawn in the page: {shown['images']}"
            )
            if re.search(r"^plt\.show\(\)", "".join(cell["source"]), re.M):
                assert pngs, f"{where}\nplt.show() drew no image: {shown['text'][:300]!r}"
            assert not re.search(r"<Figure size \d+x\d+", shown["text"]), f"{where}\nfigure as text"
            views = sum(
                "application/vnd.jupyter.widget-view+json" in o.get("data", {})
                for o in cell["outputs"]
            )
            assert shown["widgets"] == views, f"{where}\n{views} widgets, drawn: {shown['widgets']}"
            assert "Error displaying widget" not in shown["text"], where
            for bar in shown["bars"]:
                assert "progress-bar-success" in bar, f"{where}\nprogress bar not full: {bar}"
            widgets += views
        if "launch_with_progress(" in "".join("".join(c["source"]) for c in saved):
            assert any(c["bars"] for c in code), f"{stem}: no progress bar drawn"
        boxes, stuck = interact(page)
        assert not stuck, f"{stem}: these widgets did not redraw their figure: {stuck}"
        # controls a student moves (progress bars are widgets too, drawn in any lesson)
        controls = page.locator(
            ".jp-OutputArea-output .widget-slider, .jp-OutputArea-output .widget-dropdown"
        ).count()
        if stem in WIDGETS:  # a lab widget call in its source: it draws controls
            assert widgets and controls, f"{stem}: no slider or dropdown drawn ({widgets} widgets)"
        if stem.startswith("05_"):
            assert boxes >= 1, f"{stem}: the calculator (sliders and a figure) is not drawn"
        if stem not in WIDGETS:  # WIDGETS (read from the sources) misses no lesson with controls
            assert controls == 0, f"{stem} drew {controls} controls: add its call to WIDGETS"
        if request.config.getoption("--soak"):
            screenshot(page, shot)


@pytest.mark.timeout(RUN_TIMEOUT + 120)
def test_an_unsolved_lesson_shows_the_exercise_failure_at_its_check_cell(lab, page, request):
    stem = STEMS[0]
    nb = json.loads((ROOT / "lessons" / f"{stem}.ipynb").read_text())
    k = next(i for i, c in enumerate(nb["cells"]) if c["metadata"].get("minizero", {}).get("check"))
    name = nb["cells"][k]["metadata"]["minizero"]["check"]
    stub = re.search(
        r'raise NotImplementedError\("(TODO: write [^"]+)"\)',
        "".join("".join(c["source"]) for c in nb["cells"][:k]),
    )[1]
    with opened(page, lab, f"lessons/{stem}.ipynb", f"{stem}-unsolved"):
        cells = run_all(page)
        check = cells[k]["text"]
        assert f"CheckFailed: {name} raised" in check and f"NotImplementedError: {stub}" in check, (
            f"{stem}: check cell {name!r} shows:\n{check[-2000:]}"
        )
        before = [c for c in cells[:k] if c["code"]]
        assert not unrun(cells[:k]), "cells before it ran"
        assert all("Traceback" not in c["text"] for c in before), "an error before the check cell"
        if request.config.getoption("--soak"):
            page.locator(".jp-NotebookPanel .jp-Cell").nth(k).scroll_into_view_if_needed()
            screenshot(page, f"{stem}-unsolved")


def test_the_widget_lessons_are_read_from_the_sources():
    """The fast tier's set: lessons 01 (the bucket timeline's dropdown), 05 and 08 (calculators)."""
    assert WIDGETS == ["01_ddp", "05_all_stages", "08_beyond_one_node"]
