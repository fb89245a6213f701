"""One self-contained HTML page: inline CSS, images as base64 data: URIs, no script, no link.
It opens offline, from a mail attachment or a CI artifact, and looks the same everywhere."""
from __future__ import annotations

import base64
import html
from typing import Any, List, Optional, Sequence, Union

from .draw import Later, data, draw_all

CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1200px;
padding:0 16px;color:#222}
h1{font-size:22px}h2{font-size:18px;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:32px}
h3{font-size:15px}table{border-collapse:collapse;margin:8px 0 16px}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:right;font-variant-numeric:tabular-nums}
th{background:#f4f4f4}td.l,th.l{text-align:left}.figs{display:flex;flex-wrap:wrap;gap:12px}
figure{margin:0}img{max-width:100%;height:auto;border:1px solid #eee}
figcaption{font-size:12px;color:#555}.note{color:#555;font-size:13px}pre{background:#f7f7f7;padding:8px;
overflow-x:auto}
"""


def esc(v: Any) -> str:
    return html.escape(str(v))


def fmt(v: Any, spec: str = ".4g") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def rate(v: Any) -> str:
    """A throughput such as samples/s: whole units with thousands separators (24,540), never
    the 2.454e+04 of fmt's 4 significant digits."""
    return "-" if v is None else f"{v:,.0f}"


def worker_count(n: Any) -> str:
    """'1 worker', '2 workers'."""
    return f"{n} worker{'' if n == 1 else 's'}"


class Page:
    def __init__(self, title: str):
        self.title = title
        self.parts: List[Union[str, list]] = [f"<h1>{esc(title)}</h1>"]
        self.later: List[Later] = []
        """The figures to draw before render (draw.draw_all draws them side by side)."""

    def h2(self, text: str) -> None:
        self.parts.append(f"<h2>{esc(text)}</h2>")

    def h3(self, text: str) -> None:
        self.parts.append(f"<h3>{esc(text)}</h3>")

    def p(self, text: str, cls: str = "") -> None:
        self.parts.append(f"<p{' class=' + repr(cls) if cls else ''}>{esc(text)}</p>")

    def pre(self, text: str) -> None:
        self.parts.append(f"<pre>{esc(text)}</pre>")

    def table(self, header: Sequence[str], rows: Sequence[Sequence[Any]], left: int = 1) -> None:
        """`left`: how many leading columns are text (left-aligned)."""
        def cells(tag, row):
            return "".join(f"<{tag}{' class=l' if i < left else ''}>{esc(c)}</{tag}>" for i, c in enumerate(row))
        body = "".join(f"<tr>{cells('td', r)}</tr>" for r in rows)
        self.parts.append(f"<table><tr>{cells('th', header)}</tr>{body}</table>")

    def figures(self, figs: Sequence[tuple]) -> None:
        """(png bytes, a draw.Later, or None; caption) pairs, side by side where they fit; a figure
        with no bytes is skipped. Laid out by draw(), once every figure of the page is named."""
        row = list(figs)
        self.later.extend(b for b, _ in row if isinstance(b, Later))
        self.parts.append(row)

    def draw(self) -> None:
        """Draw the page's figures (side by side where it can: draw.draw_all) and lay them out."""
        draw_all(self.later)
        self.later = []
        parts = [p if isinstance(p, str) else _figure_row(p) for p in self.parts]
        self.parts = [p for p in parts if p]

    def render(self) -> str:
        self.draw()
        return ("<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
                "<meta name=viewport content='width=device-width,initial-scale=1'>"
                f"<title>{esc(self.title)}</title><link rel=icon href='data:,'><style>{CSS}</style></head><body>"
                + "\n".join(self.parts) + "</body></html>\n")


def _figure_row(row: Sequence[tuple]) -> str:
    items = [image(data(b), c) for b, c in row if data(b)]
    return f"<div class=figs>{''.join(items)}</div>" if items else ""


def image(data: bytes, caption: Optional[str] = None) -> str:
    b64 = base64.b64encode(data).decode("ascii")
    cap = f"<figcaption>{esc(caption)}</figcaption>" if caption else ""
    return f"<figure><img src=\"data:image/png;base64,{b64}\" alt=\"{esc(caption or 'figure')}\">{cap}</figure>"
