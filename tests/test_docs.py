"""Every code block of the README and the guide pages runs here, so none goes stale.

Each page runs top to bottom in one namespace named ``__main__`` (as a reader's script or
session), in a fresh directory, against one embedded S3 server with MinIO's default keys
that every page shares, in the order of the site, as a reader who follows them all would:
the endpoint the pages write, ``127.0.0.1:9000``, is replaced by the server's. A page
starts with no ``AWS_*`` variable in its environment, as a fresh terminal's: what its
``s3://`` forms need, the page exports itself. Every setup a page needs is a block the
reader sees: nothing runs from an HTML comment. The README's code
also runs as a script under the ``spawn`` start method (macOS, Windows), where only code
under ``if __name__ == "__main__":`` may start processes. Fences say what a block is:

- ``python``: executed.
- ``bash``: each line is a ``remote-loader`` command, run (as ``python -m remote_loader``)
  and expected to succeed.
- ``console``: commands for the reader's own machine (installing, ``make``, ``torchrun``
  across nodes, a long-running server); shown, not run, but for ``export NAME=VALUE ...``
  lines, which set the page's environment as they would the reader's shell.
- ``text`` or no language: output, layouts and diagrams, not code. No ``mermaid``: the site
  would draw it with a script fetched online, and offline a reader sees its source. A
  ``text`` block right after a ``bash`` block (blank lines between them at most) is what its
  commands print, run in ``/home/me`` by user 1000 against ``127.0.0.1:9000``: checked.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from remote_loader.testing.server import EmbeddedS3

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOCUMENTED_ENDPOINT = "127.0.0.1:9000"  # with or without http://
KINDS = {"python", "bash", "console", "text", ""}
WITHOUT_CODE = {"performance.md", "FORMAT.md", "api.md", "architecture.md"}

_FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```\n", re.M | re.S)
_COMMENT = re.compile(r"<!--.*?-->", re.S)


@dataclass(frozen=True)
class Block:
    kind: str
    code: str
    line: int
    hidden: bool


def blocks(text: str) -> list[Block]:
    hidden = [m.span() for m in _COMMENT.finditer(text)]
    return [
        Block(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1,
              any(a <= m.start() < b for a, b in hidden))
        for m in _FENCE.finditer(text)
    ]


def test_pages_are_found_and_every_fence_says_what_it_is() -> None:
    assert len(PAGES) >= 10, PAGES
    unknown = [(page.name, b.line, b.kind) for page in PAGES for b in blocks(page.read_text()) if b.kind not in KINDS]
    assert not unknown, f"fences with a language the docs test does not know: {unknown}"


def test_the_block_reader_sees_hidden_blocks_and_line_numbers() -> None:
    text = "a\n```python\nx = 1\n```\n<!--\n```python\ny = 2\n```\n-->\n```\nout\n```\n"
    assert blocks(text) == [
        Block("python", "x = 1\n", 2, False),
        Block("python", "y = 2\n", 6, True),
        Block("", "out\n", 10, False),
    ]


def test_no_page_hides_code_from_its_reader() -> None:
    hidden = [(page.name, b.line) for page in PAGES for b in blocks(page.read_text()) if b.hidden]
    assert not hidden, f"blocks in HTML comments, which a reader cannot follow: {hidden}"


CODE_COLUMNS = 110  # what a code block shows without scrolling in a 1280 px window (docs/stylesheets/extra.css)


def test_no_code_line_is_wider_than_the_page_shows() -> None:
    wide = [
        f"{page.name}:{b.line + 1 + i}"
        for page in PAGES
        for b in blocks(page.read_text())
        for i, line in enumerate(b.code.splitlines())
        if len(line) > CODE_COLUMNS
    ]
    assert not wide, f"code lines over {CODE_COLUMNS} columns, clipped on the site: {wide}"


def test_the_readme_stays_short() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedS3]:
    """One server for every page, as a reader following the whole guide has."""
    with EmbeddedS3(data_dir=str(tmp_path_factory.mktemp("docs-s3"))) as server:
        yield server


@pytest.fixture
def server(shared_server: EmbeddedS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[EmbeddedS3]:
    for name in list(os.environ):
        if name.startswith("AWS_"):  # a fresh terminal's: the page exports what it needs
            monkeypatch.delenv(name)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.syspath_prepend(str(work))
    yield shared_server


def _exports(block: Block, endpoint: str) -> dict[str, str]:
    """The variables the ``export`` lines of a console block set, the documented endpoint
    replaced by the server's."""
    names: dict[str, str] = {}
    for line in block.code.splitlines():
        if line.startswith("export "):
            words = shlex.split(line.replace(DOCUMENTED_ENDPOINT, endpoint.removeprefix("http://")), comments=True)
            names.update(word.split("=", 1) for word in words[1:])  # type: ignore[misc]
    return names


def _run_command(line: str, where: str, endpoint: str) -> str:
    """What the ``remote-loader`` command ``line`` prints, as the page's reader would see it
    (``/home/me`` the working directory, 1000 the user id, the documented endpoint)."""
    words = shlex.split(line.replace(DOCUMENTED_ENDPOINT, endpoint.removeprefix("http://")), comments=True)
    if not words:
        return ""
    assert words[0] == "remote-loader", (
        f"{where}: a bash block holds only remote-loader commands (use console for others): {line}"
    )
    done = subprocess.run(
        [sys.executable, "-m", "remote_loader", *words[1:]],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert done.returncode == 0, f"{where}: {line}\n{done.stdout}\n{done.stderr}"
    return (done.stdout.replace(os.getcwd(), "/home/me").replace(f"remote-loader-{os.geteuid()}", "remote-loader-1000")
            .replace(endpoint.removeprefix("http://"), DOCUMENTED_ENDPOINT))


def _output_shown(lines: list[str], block: Block, previous: Block | None) -> bool:
    """Whether ``block`` is a ``text`` block right after the ``bash`` block ``previous``:
    the output the page shows for its commands."""
    if block.kind != "text" or previous is None or previous.kind != "bash":
        return False
    after = previous.line + previous.code.count("\n") + 1  # the line of the closing fence
    return all(not line.strip() for line in lines[after : block.line - 1])


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_code_block_of_the_page_runs(page: Path, server: EmbeddedS3, monkeypatch: pytest.MonkeyPatch) -> None:
    namespace: dict[str, object] = {"__name__": "__main__"}
    ran, previous, printed = 0, None, ""
    for block in blocks(page.read_text()):
        where = f"{page.name}:{block.line}"
        if _output_shown(page.read_text().splitlines(), block, previous):
            assert printed == block.code, f"{where} shows other output than its commands print:\n{printed}"
        previous = block
        if block.kind == "python":
            code = block.code.replace(DOCUMENTED_ENDPOINT, server.endpoint_url.removeprefix("http://"))
            exec(compile(code, where, "exec"), namespace)  # noqa: S102 - the page's own code
            ran += 1
        elif block.kind == "bash":
            printed = "".join(_run_command(line, f"{page.name}:{block.line + 1 + number}", server.endpoint_url)
                              for number, line in enumerate(block.code.splitlines()))
            ran += 1
        elif block.kind == "console":
            for name, value in _exports(block, server.endpoint_url).items():
                monkeypatch.setenv(name, value)
    assert ran or page.name in WITHOUT_CODE, f"{page.name} has no code block that runs"


def test_only_the_pages_meant_to_have_no_code_have_none() -> None:
    without = {page.name for page in PAGES if not any(b.kind in ("python", "bash") for b in blocks(page.read_text()))}
    assert without == WITHOUT_CODE


_SPAWN = """import multiprocessing
multiprocessing.set_start_method("spawn", force=True)  # as on macOS and Windows: workers import this script
"""


def test_the_readme_runs_as_a_script_under_spawn(shared_server: EmbeddedS3, tmp_path: Path) -> None:
    """A reader on macOS or Windows who pastes the README's blocks into a file: DataLoader and
    upload workers import the script again, which only the guard keeps from starting anew."""
    code = "".join(b.code for b in blocks((ROOT / "README.md").read_text()) if b.kind == "python")
    script = tmp_path / "readme.py"
    script.write_text(
        _SPAWN
        + code.replace(DOCUMENTED_ENDPOINT, shared_server.endpoint_url.removeprefix("http://"))
        .replace('base_folder="synthetic"', 'base_folder="spawned"')
        .replace('"datasets", "synthetic"', '"datasets", "spawned"')
    )
    out = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **{name: value for name, value in os.environ.items() if not name.startswith("AWS_")},
            **{
                name: value
                for block in blocks((ROOT / "README.md").read_text())
                if block.kind == "console"
                for name, value in _exports(block, shared_server.endpoint_url).items()
            },
        },
    )
    assert out.returncode == 0, out.stderr[-3000:]
