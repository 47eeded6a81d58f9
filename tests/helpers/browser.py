"""A real browser for the live page's tests: Debian's headless Chromium (``make setup`` installs it when missing).

:func:`rendered_page` opens a URL in a fresh profile, lets its scripts run for a budget of virtual time (Chromium's
``--virtual-time-budget``: the page's fetches and timers run as fast as they can, then the DOM is dumped) and
returns the DOM as :class:`Page`, whose elements a test finds by their ``data-*`` attributes. The flags are the
ones a closed network needs (no background connections, no component updates, no sync: docs of the machine).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from html.parser import HTMLParser

import pytest

CHROMIUM = "chromium"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)

VOID = ("area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr")
"""HTML's elements without an end tag (Chromium's dump closes every SVG element)."""


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    ancestors: tuple[Element, ...] = ()
    text: str = ""


class Page(HTMLParser):
    """The elements of a dumped DOM (tag, attributes, text), in document order."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: list[Element] = []
        self._open: list[Element] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = Element(tag, {k: v or "" for k, v in attrs}, tuple(self._open))
        self.elements.append(element)
        if tag not in VOID:
            self._open.append(element)

    def handle_endtag(self, tag: str) -> None:
        if any(e.tag == tag for e in self._open):
            while self._open.pop().tag != tag:
                pass

    def handle_data(self, data: str) -> None:
        for element in self._open:
            element.text += data

    def find(self, tag: str | None = None, within: Element | None = None, **attrs: str) -> list[Element]:
        """The elements (of ``tag``, inside ``within``, when given) with every ``attrs`` (underscores in a name are
        dashes: ``data_field="loss"``)."""
        want = {k.replace("_", "-"): v for k, v in attrs.items()}
        return [
            e
            for e in self.elements
            if all(e.attrs.get(k) == v for k, v in want.items())
            and (tag is None or e.tag == tag)
            and (within is None or any(a is within for a in e.ancestors))
        ]

    def one(self, tag: str | None = None, within: Element | None = None, **attrs: str) -> Element:
        (found,) = self.find(tag, within, **attrs)
        return found


def rendered_page(url: str, budget_ms: int = 4000) -> Page:
    """The DOM of ``url`` after its scripts ran for ``budget_ms`` of virtual time (skips the test without Chromium)."""
    binary = shutil.which(CHROMIUM)
    if binary is None:
        pytest.skip("no chromium on this machine: `make setup` installs Debian's package")
    with tempfile.TemporaryDirectory() as profile:
        argv = [binary, *FLAGS, f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}", "--dump-dom", url]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    page = Page()
    page.feed(proc.stdout)
    return page
