"""matplotlib, headless (Agg), and a figure's PNG bytes: the only place reports touch the backend."""
from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")  # no display; set before pyplot is imported anywhere
import matplotlib.pyplot as plt  # noqa: E402

DPI = 100


def figure(w: float = 7.0, h: float = 4.2, **kw):
    fig, ax = plt.subplots(figsize=(w, h), **kw)
    return fig, ax


def png(fig) -> bytes:
    """Render and close (pyplot keeps every open figure alive otherwise)."""
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=DPI)
    plt.close(fig)
    return buf.getvalue()
