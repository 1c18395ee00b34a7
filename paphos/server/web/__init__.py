"""The built-in web page at `/` (issue #22); `--disable-web-ui` turns it off.

`index.html`, `app.css` and `app.js` are package data beside this module; the page talks only to
the public API routes (`/v1/models`, `/v1/chat/completions`, `/v1/completions`). It is served as
one document, the stylesheet and the script inlined into the HTML: `/` is the only page path that
auth.py leaves open when API keys are set, and the page asks for the key and sends it as
`Authorization: Bearer` itself. The Content-Security-Policy allows exactly those two inline blocks
(by hash) and connections to this origin only, so model output can never run as script.
"""

from __future__ import annotations

import base64
import hashlib
from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter(include_in_schema=False)

# The tags of index.html that the served page replaces by the files' contents.
_STYLE_TAG = '<link rel="stylesheet" href="app.css">'
_SCRIPT_TAG = '<script type="module" src="app.js"></script>'


def _source(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def _hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


@cache
def page() -> tuple[str, str]:
    """The page's HTML with its CSS and JS inlined, and the Content-Security-Policy that goes with it."""
    html, css, js = _source("index.html"), _source("app.css"), _source("app.js")
    if _STYLE_TAG not in html or _SCRIPT_TAG not in html:
        raise RuntimeError("index.html lost its stylesheet or script tag")
    if "</style" in css.lower() or "</script" in js.lower():
        raise RuntimeError("app.css / app.js must not contain a closing tag: they are inlined")
    html = html.replace(_STYLE_TAG, f"<style>{css}</style>")
    html = html.replace(_SCRIPT_TAG, f'<script type="module">{js}</script>')
    csp = "; ".join((
        "default-src 'none'", f"script-src {_hash(js)}", f"style-src {_hash(css)}", "connect-src 'self'",
        "img-src data:", "base-uri 'none'", "form-action 'none'", "frame-ancestors 'none'",
    ))
    return html, csp


@router.api_route("/", methods=["GET", "HEAD"])
async def index() -> HTMLResponse:
    html, csp = page()
    return HTMLResponse(html, headers={
        "Content-Security-Policy": csp, "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    })
