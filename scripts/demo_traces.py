"""Deterministic synthetic browser-agent chat traces (OpenAI chat format, PNG screenshots) as .jsonl.zst.
Same arguments give a byte-identical file; used by the demo, the tests and the benchmarks.
"""

from __future__ import annotations

import argparse
import base64
import functools
import inspect
import io
import json
import os
import random
from pathlib import Path
from typing import Iterator

import numpy as np
import zstandard
from PIL import Image, ImageDraw, ImageFont

CHROME_H = 40
REPEAT_P = 0.12  # not every step can be a no-op, so this lands near 10% repeated screenshots
BARE_IMAGE_URL_P = 0.15
OBJECT_ARGS_P = 0.20

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "click",
            "description": "Left-click at a pixel position of the current screenshot.",
            "parameters": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "description": "Horizontal pixel, 0 at the left edge."},
                    "y": {"type": "integer", "description": "Vertical pixel, 0 at the top edge."},
                },
                "required": ["x", "y"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "type",
            "description": "Type text into the focused input field.",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "scroll",
            "description": "Scroll the page vertically; positive dy scrolls down.",
            "parameters": {"type": "object", "properties": {"dy": {"type": "integer"}}, "required": ["dy"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "navigate",
            "description": "Load a URL in the current tab.",
            "parameters": {"type": "object", "properties": {"url": {"type": "string"}}, "required": ["url"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "done",
            "description": "Finish the task with a final answer.",
            "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
        },
    },
]

SYSTEM_PROMPTS = [
    "You are a browser agent. You see screenshots of a web browser and act with the provided tools. "
    "Think briefly before each action and give a concise final answer.",
    "You control a web browser through function calls. Each tool result includes a new screenshot. "
    "Coordinates are in screenshot pixels.",
    "You are a helpful assistant that completes tasks on websites. Use click, type, scroll and navigate. "
    "When the task is complete, reply with the answer in plain text.",
]

# (domain, name, header colour, page kinds the site serves)
SITES = [
    ("shop.acme-demo.com", "Acme Shop", (232, 110, 40), ("results", "product", "form", "table")),
    ("news.dailyledger.example", "Daily Ledger", (40, 60, 110), ("article", "results", "article")),
    ("flights.skyhop.example", "SkyHop", (20, 130, 170), ("form", "table", "results")),
    ("docs.pyrite.dev", "Pyrite Docs", (60, 60, 70), ("article", "results", "table")),
    ("bank.northmoor.example", "Northmoor Bank", (20, 100, 60), ("table", "form", "article")),
    ("jobs.workwell.example", "WorkWell Jobs", (110, 50, 140), ("results", "article", "form")),
    ("recipes.panful.example", "Panful", (190, 50, 60), ("article", "results", "product")),
    ("tickets.venuebox.example", "VenueBox", (200, 150, 20), ("table", "product", "form")),
]

WORDS = (
    "the a of and to in for with on by from at as is are was be this that it new all more your our "
    "price order account search result item details page form table update report review total "
    "shipping delivery return policy support contact service data file project team customer "
    "flight hotel ticket event date time city room guest payment card balance transfer statement "
    "recipe minutes oven salt butter garlic fresh simple quick easy best top latest popular "
    "available stock color size model brand rating reviews compare filter sort apply save cancel "
    "settings profile security password email phone address country region language help guide "
    "install configure release version module function example error warning note section "
    "market growth quarter revenue energy policy local global research study health travel"
).split()
PRODUCTS = [
    "wireless mouse",
    "standing desk",
    "espresso grinder",
    "trail backpack",
    "4K monitor",
    "noise-cancelling headphones",
    "cast iron skillet",
    "mechanical keyboard",
    "yoga mat",
    "LED desk lamp",
    "rain jacket",
    "water bottle",
    "USB-C hub",
    "office chair",
    "air purifier",
]
CITIES = ["Lisbon", "Denver", "Osaka", "Nairobi", "Toronto", "Berlin", "Santiago", "Austin", "Hanoi", "Oslo"]
MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]
FIELDS = [
    "Full name",
    "Email",
    "Phone",
    "Street address",
    "City",
    "Postal code",
    "Departure",
    "Arrival",
    "Date",
    "Passengers",
    "Company",
    "Message",
    "Card number",
    "Promo code",
]
FIELD_VALUES = {
    "Full name": "Dana Lee",
    "Email": "dana.lee@example.com",
    "Phone": "+1 555 01{day:02d}",
    "Street address": "{day} Harbor Street",
    "City": "{city}",
    "Postal code": "9{minute:02d}{day:02d}",
    "Departure": "{city}",
    "Arrival": "{city2}",
    "Date": "{month} {day}, 2024",
    "Passengers": "2",
    "Company": "{word} labs",
    "Message": "Hello, I have a question about {word} {word2}.",
    "Card number": "4111 1111 1111 1111",
    "Promo code": "SAVE{day}",
    "Search": "{product}",
    "Quantity": "{day}",
}
FORM_TITLES = [
    "Contact us",
    "Checkout",
    "Create account",
    "Search flights",
    "Transfer funds",
    "Apply now",
    "Shipping details",
    "Book tickets",
]
TABLE_TITLES = [
    "Recent orders",
    "Available flights",
    "Transactions",
    "API reference",
    "Open positions",
    "Upcoming events",
    "Price history",
]
NAV = ["Home", "Deals", "Account", "Help", "Orders", "Sign in", "Docs", "About", "Cart", "Search"]
BUTTONS = [
    "Apply",
    "Continue",
    "Submit",
    "Next",
    "Show more",
    "Filter",
    "Sort by price",
    "Details",
    "Save",
    "Compare",
    "Select",
    "Add to list",
]

TASKS = [
    "Find the cheapest {product} on {site} and tell me its price.",
    "On {site}, add a {product} to the cart and report the cart total.",
    "Search {site} for flights from {city} to {city2} on {month} {day} and give me the earliest departure.",
    "Open {site} and find the latest article about {word} {word2}. Summarize the headline.",
    "Fill in the contact form on {site} with the name Dana Lee and email dana.lee@example.com, then submit.",
    "Check the last three transactions on {site} and tell me which one is the largest.",
    "Look up the return policy on {site} for a {product}.",
    "Find an open position on {site} in {city} and report its title.",
    "On {site}, find a recipe with {word} that takes under {day} minutes.",
    "How many tickets are left for the {month} {day} event on {site}?",
]
OBSERVE = [
    "The page shows {title}.",
    "I can see the {title} page on {site}.",
    "The screenshot now shows {title}.",
    "We are on {site}, currently at {title}.",
    "The page loaded: {title}.",
    "I'm looking at {title}.",
]
INTEND_CLICK = [
    "I'll click '{label}' to continue.",
    "The '{label}' element looks like the right next step, so I'll click it.",
    "Clicking '{label}' should get me closer to the goal.",
    "Next I'll open '{label}'.",
    "I need to press '{label}'.",
]
INTEND_TYPE = [
    "The {label} field is focused, so I'll type the value now.",
    "I'll enter '{text}' into {label}.",
    "Typing the {label} value.",
]
INTEND_FOCUS = [
    "I need to fill in {label} first, so I'll click into that field.",
    "I'll click the {label} input.",
]
INTEND_SCROLL = [
    "The information I need is probably further down, so I'll scroll.",
    "I'll scroll to see more of the page.",
    "Nothing relevant is visible yet; scrolling down.",
    "The rest of the list is below the fold.",
]
INTEND_SCROLL_UP = [
    "Let me scroll back up to check the top of the page.",
    "I scrolled past it; going back up.",
    "The field I need is above the visible area, so I'll scroll up.",
]
INTEND_NAV = [
    "It will be faster to go directly to {url}.",
    "I'll navigate straight to {url}.",
    "This page is not useful; I'll open {url} instead.",
]
INTEND_REPEAT = [
    "The page did not seem to react, so I'll click the same spot again.",
    "Nothing changed after the last click; trying once more.",
    "Let me click again; the page may still be loading.",
]
PLAN = [
    "After that I should check the result.",
    "Then I'll verify the values before finishing.",
    "This should reveal the details I need.",
    "",
    "",
    "",
]
ANSWERS = [
    "Done. The {product} costs ${price}.",
    "The task is complete: the total shown is ${price}.",
    "I found it: '{title}' on {site}.",
    "The form was submitted successfully; the confirmation number is {code}.",
    "The earliest option departs at {hour}:{minute:02d} and costs ${price}.",
    "The largest item is {code}, for ${price}.",
    "There are {day} left according to {site}.",
]
CHAT_Q = [
    "What is the difference between a cookie and local storage in a browser?",
    "Can you explain what an HTTP 302 redirect does?",
    "Give me three tips for writing a good bug report.",
    "How do I convert {day} degrees Celsius to Fahrenheit?",
    "Summarize what a CSS flexbox container does.",
    "Why would a form submit button be disabled on a web page?",
    "What does the {word} {word2} setting usually control?",
]
CHAT_A = [
    "Cookies are sent to the server with every request and can expire, while local storage stays in the browser "
    "and is only read by scripts.",
    "A 302 tells the browser the resource is temporarily at another URL, which it then requests.",
    "Describe the exact steps, the expected result and the actual result, and attach a screenshot.",
    "Multiply by 9/5 and add 32.",
    "A flex container lays out its children along one axis and distributes spare space.",
    "Usually because required fields are empty or invalid, or a request is still pending.",
    "It depends on the product, but it usually controls how {word} data is stored and shared.",
]
PALETTE = [
    (66, 133, 244),
    (52, 168, 83),
    (251, 188, 5),
    (234, 67, 53),
    (103, 58, 183),
    (0, 150, 136),
    (255, 112, 67),
    (96, 125, 139),
    (233, 30, 99),
    (121, 85, 72),
]


@functools.lru_cache(maxsize=None)
def _font(size: int):
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1 has only the fixed bitmap font
        return ImageFont.load_default()


class _Glyphs:
    """Per-size glyph cells, rendered once: FreeType layout costs ~1 ms per line, concatenating cells ~40 us."""

    def __init__(self, font):
        self.font = font
        asc, desc = font.getmetrics()
        self.h = asc + desc
        self.cells: dict[str, np.ndarray] = {}

    def _cell(self, ch: str) -> np.ndarray:
        c = self.cells.get(ch)
        if c is None:
            w = max(1, round(self.font.getlength(ch)))
            g = Image.new("L", (w, self.h), 0)
            ImageDraw.Draw(g).text((0, 0), ch, font=self.font, fill=255)
            c = self.cells[ch] = np.asarray(g)
        return c

    def mask(self, text: str) -> Image.Image:
        cells = self.cells
        return Image.fromarray(
            np.concatenate([cells.get(ch) if ch in cells else self._cell(ch) for ch in text], axis=1)
        )

    def width(self, text: str) -> int:
        return sum((self.cells[ch] if ch in self.cells else self._cell(ch)).shape[1] for ch in text)


@functools.lru_cache(maxsize=None)
def _glyphs(size: int) -> _Glyphs | None:
    f = _font(size)
    return _Glyphs(f) if isinstance(f, ImageFont.FreeTypeFont) else None


def _textw(text: str, size: int) -> int:
    g = _glyphs(size)
    return g.width(text) if g is not None else int(_font(size).getlength(text))


def _text(
    im: Image.Image, d: ImageDraw.ImageDraw, xy: tuple[int, int], text: str, size: int, fill, anchor: str = "la"
) -> None:
    g = _glyphs(size)
    if g is None or not text:
        d.text(xy, text, font=_font(size), fill=fill, anchor=anchor)
        return
    m = g.mask(text)
    x, y = xy
    if anchor[0] == "m":
        x -= m.width // 2
    if anchor[1] == "m":
        y -= g.h // 2
    im.paste(fill, (int(x), int(y)), m)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _sentence(rng: random.Random, lo: int = 5, hi: int = 14) -> str:
    s = _words(rng, rng.randint(lo, hi))
    return s[0].upper() + s[1:] + "."


def _lines(rng: random.Random, width_px: int, size: int, count: int) -> list[str]:
    # Approximate glyph width instead of measuring: layout only needs to look plausible, and it is much faster.
    chars = max(8, int(width_px / (size * 0.5)))
    out = []
    for _ in range(count):
        s = ""
        while len(s) < chars - 8:
            s += rng.choice(WORDS) + " "
        out.append(s[:chars].rstrip())
    return out


_COLUMNS = {
    "Date": lambda r: f"{r.choice(MONTHS)} {r.randint(1, 28)}",
    "ID": lambda r: f"#{r.randint(10000, 99999)}",
    "Amount": lambda r: f"${r.randint(5, 4000)}.{r.randint(0, 99):02d}",
    "City": lambda r: r.choice(CITIES),
    "Status": lambda r: r.choice(["Paid", "Pending", "Shipped", "Open", "Closed"]),
    "Qty": lambda r: str(r.randint(1, 40)),
    "Name": lambda r: r.choice(PRODUCTS).title(),
}


# A page item's style, in the item tuple's order after (op, box): the defaults of _Page._add.
ITEM_STYLE = {"fill": None, "outline": None, "text": "", "size": 14, "tfill": (30, 30, 30), "label": None, "ck": None}


class _Page:
    """One page: items in page coordinates (y from the top of the page, below the browser chrome)."""

    def __init__(self, site: tuple, kind: str, path: str, seed: int, W: int, H: int, query: str):
        self.site, self.kind, self.path, self.seed = site, kind, path, seed
        self.W, self.H, self.query = W, H, query
        self.fields: dict[str, str] = {}
        self.focus: str | None = None
        self.scroll = 0
        self.banner: str | None = None
        rng = random.Random(seed)
        self.title = self._title(rng)
        self.items: list[tuple] = []
        self.height = self._layout(rng)

    @property
    def url(self) -> str:
        return f"https://{self.site[0]}/{self.path}"

    def _title(self, rng: random.Random) -> str:
        if self.kind == "results":
            return f'Results for "{self.query}"'
        if self.kind == "product":
            return rng.choice(["Acme", "Nordic", "Vertex", "Kiko", "Halden"]) + " " + rng.choice(PRODUCTS).title()
        if self.kind == "form":
            return rng.choice(FORM_TITLES)
        if self.kind == "table":
            return rng.choice(TABLE_TITLES)
        return _sentence(rng, 4, 9)[:-1].title()

    def _add(self, op, box, **style):
        """An item: (op, box, then ITEM_STYLE's keys in order: fill, outline, text, size, text fill, label, clickable
        kind), each style its default unless given."""
        assert style.keys() <= ITEM_STYLE.keys(), sorted(style.keys() - ITEM_STYLE.keys())
        self.items.append((op, box, *{**ITEM_STYLE, **style}.values()))

    def _button(self, x, y, label, color, w=None):
        w = w or _textw(label, 14) + 28
        self._add(
            "button",
            (x, y, x + w, y + 34),
            fill=color,
            text=label,
            size=14,
            tfill=(255, 255, 255),
            label=label,
            ck="button",
        )
        return w

    def _layout(self, rng: random.Random) -> int:
        W, color = self.W, self.site[2]
        mx = max(12, W // 20)
        side = W >= 800 and rng.random() < 0.6
        mw = int((W - 2 * mx) * (0.68 if side else 1.0))
        self._add("rect", (0, 0, W, 52), fill=color, text=self.site[1], size=20, tfill=(255, 255, 255))
        x = W - mx
        for lab in rng.sample(NAV, 4):
            w = _textw(lab, 14)
            x -= w + 14
            if x < mx + 180:
                break
            self._add("link", (x, 16, x + w, 36), text=lab, size=14, tfill=(255, 255, 255), label=lab, ck="link")
        y = 70
        self._add("text", (mx, y, mx + mw, y + 30), text=self.title, size=24)
        y += 44
        k = self.kind
        if k == "results":
            self._add(
                "input",
                (mx, y, mx + int(mw * 0.7), y + 34),
                fill=(255, 255, 255),
                outline=(150, 150, 150),
                text=self.query,
                label="Search",
                ck="input",
            )
            self._button(mx + int(mw * 0.7) + 10, y, "Search", (66, 133, 244))
            y += 54
            for _ in range(rng.randint(6, 11)):
                thumb = rng.random() < 0.4
                tx = mx + (110 if thumb else 0)
                if thumb:
                    self._add("rect", (mx, y, mx + 96, y + 72), fill=rng.choice(PALETTE))
                lab = _sentence(rng, 3, 7)[:-1].title()
                self._add(
                    "link",
                    (tx, y, tx + min(mw - 110, _textw(lab, 17)), y + 22),
                    text=lab,
                    size=17,
                    tfill=(26, 13, 171),
                    label=lab,
                    ck="link",
                )
                self._add(
                    "text",
                    (tx, y + 24, tx + mw, y + 40),
                    text=f"{self.site[0]}/{rng.choice(WORDS)}/{rng.randint(100, 99999)}",
                    size=12,
                    tfill=(0, 110, 40),
                )
                for j, ln in enumerate(_lines(rng, mw - (tx - mx), 13, 2)):
                    self._add(
                        "text", (tx, y + 42 + 17 * j, tx + mw, y + 58 + 17 * j), text=ln, size=13, tfill=(80, 80, 80)
                    )
                y += 96
        elif k == "product":
            iw = min(360, mw // 2)
            self._add("rect", (mx, y, mx + iw, y + iw), fill=(240, 240, 240), outline=(200, 200, 200))
            c = rng.choice(PALETTE)
            self._add("ellipse", (mx + iw // 5, y + iw // 5, mx + 4 * iw // 5, y + 4 * iw // 5), fill=c)
            rx = mx + iw + 24
            self._add(
                "text",
                (rx, y, rx + 300, y + 20),
                text="*" * rng.randint(3, 5) + f"  {rng.randint(3, 2400)} reviews",
                size=14,
                tfill=(200, 130, 0),
            )
            price = f"${rng.randint(9, 899)}.{rng.randint(0, 99):02d}"
            self._add("text", (rx, y + 30, rx + 200, y + 64), text=price, size=30, tfill=(180, 30, 30))
            self._add(
                "text",
                (rx, y + 76, rx + 300, y + 92),
                text=f"In stock - ships in {rng.randint(1, 9)} days",
                size=13,
                tfill=(0, 120, 0),
            )
            self._add(
                "input",
                (rx, y + 104, rx + 80, y + 138),
                fill=(255, 255, 255),
                outline=(150, 150, 150),
                text="1",
                label="Quantity",
                ck="input",
            )
            bw = self._button(rx, y + 152, "Add to cart", (240, 150, 20))
            self._button(rx + bw + 12, y + 152, "Buy now", (230, 90, 20))
            y += iw + 24
            for _ in range(rng.randint(2, 4)):
                for ln in _lines(rng, mw, 14, rng.randint(3, 5)):
                    self._add("text", (mx, y, mx + mw, y + 18), text=ln, size=14)
                    y += 20
                y += 12
        elif k == "form":
            self._add("rect", (mx, y, mx + mw, y + 8), fill=(230, 230, 230))
            y += 24
            fw = min(520, mw)
            for lab in rng.sample(FIELDS, rng.randint(3, 6)):
                self._add("text", (mx, y, mx + fw, y + 18), text=lab, size=14, tfill=(60, 60, 60))
                self._add(
                    "input",
                    (mx, y + 20, mx + fw, y + 54),
                    fill=(255, 255, 255),
                    outline=(150, 150, 150),
                    text="",
                    label=lab,
                    ck="input",
                )
                y += 70
            self._add("rect", (mx, y + 4, mx + 16, y + 20), fill=(255, 255, 255), outline=(100, 100, 100))
            self._add("text", (mx + 26, y + 4, mx + fw, y + 20), text="I agree to the terms and conditions", size=13)
            y += 36
            bw = self._button(mx, y, rng.choice(["Submit", "Continue", "Send", "Search"]), (66, 133, 244))
            self._button(mx + bw + 12, y, "Cancel", (150, 150, 150))
            y += 60
        elif k == "table":
            bx = mx
            for lab in rng.sample(BUTTONS, 3):
                bx += self._button(bx, y, lab, rng.choice(PALETTE)) + 10
            y += 50
            cols = rng.randint(3, 5)
            cw = mw // cols
            heads = rng.sample(sorted(_COLUMNS), cols)
            self._add("rect", (mx, y, mx + mw, y + 30), fill=(235, 238, 242))
            for c, hname in enumerate(heads):
                self._add(
                    "text", (mx + c * cw + 8, y + 7, mx + (c + 1) * cw, y + 25), text=hname, size=14, tfill=(40, 40, 40)
                )
            y += 30
            for r in range(rng.randint(8, 16)):
                if r % 2:
                    self._add("rect", (mx, y, mx + mw, y + 28), fill=(248, 248, 250))
                for c in range(cols):
                    v = _COLUMNS[heads[c]](rng)
                    ck = "link" if c == 0 else None
                    x0 = mx + c * cw + 8
                    self._add(
                        "link" if ck else "text",
                        (x0, y + 6, x0 + _textw(v, 13), y + 24),
                        text=v,
                        size=13,
                        tfill=(26, 13, 171) if ck else (50, 50, 50),
                        label=v,
                        ck=ck,
                    )
                y += 28
            y += 16
            bx = mx
            for lab in ["< Prev", "1", "2", "3", "Next >"]:
                bx += self._button(bx, y, lab, (120, 120, 130), w=max(34, _textw(lab, 14) + 16)) + 6
            y += 54
        else:
            self._add(
                "text",
                (mx, y, mx + mw, y + 16),
                text=f"By {rng.choice(['A. Rivera', 'K. Osei', 'M. Tanaka'])}"
                f" - {rng.choice(MONTHS)} {rng.randint(1, 28)}, 2024",
                size=12,
                tfill=(110, 110, 110),
            )
            y += 28
            for p in range(rng.randint(4, 8)):
                if p == 2 and rng.random() < 0.6:
                    self._add("rect", (mx, y, mx + mw, y + 180), fill=rng.choice(PALETTE))
                    y += 196
                for ln in _lines(rng, mw, 15, rng.randint(3, 6)):
                    self._add("text", (mx, y, mx + mw, y + 18), text=ln, size=15)
                    y += 22
                y += 14
            lab = rng.choice(["Read more", "Related articles", "Next page", "Comments"])
            self._add(
                "link",
                (mx, y, mx + _textw(lab, 15), y + 20),
                text=lab,
                size=15,
                tfill=(26, 13, 171),
                label=lab,
                ck="link",
            )
            y += 40
        if side:
            sx, sy = mx + mw + 24, 114
            sw = W - mx - sx
            for _ in range(rng.randint(2, 3)):
                self._add("rect", (sx, sy, sx + sw, sy + 150), fill=(246, 247, 249), outline=(220, 220, 225))
                self._add("text", (sx + 12, sy + 10, sx + sw, sy + 28), text=_sentence(rng, 2, 3)[:-1].title(), size=16)
                for j, ln in enumerate(_lines(rng, sw - 24, 13, 2)):
                    self._add(
                        "text",
                        (sx + 12, sy + 36 + 18 * j, sx + sw, sy + 52 + 18 * j),
                        text=ln,
                        size=13,
                        tfill=(90, 90, 90),
                    )
                self._button(sx + 12, sy + 100, rng.choice(BUTTONS), rng.choice(PALETTE))
                sy += 166
            y = max(y, sy)
        self._add(
            "rect",
            (0, y, W, y + 80),
            fill=(40, 42, 48),
            text=f"(c) 2024 {self.site[1]} - Privacy - Terms",
            size=12,
            tfill=(200, 200, 200),
        )
        return y + 80

    @property
    def view_h(self) -> int:
        return max(1, self.H - CHROME_H)

    @property
    def max_scroll(self) -> int:
        return max(0, self.height - self.view_h)

    def targets(self) -> list[tuple[str, str, int, int]]:
        """Visible clickable elements as (label, kind, screen x, screen y) of their centres."""
        out = []
        for _op, (x0, y0, x1, y1), *_rest, label, ck in self.items:
            if ck is None:
                continue
            cx, cy = (x0 + x1) // 2, CHROME_H + (y0 + y1) // 2 - self.scroll
            if CHROME_H + 4 <= cy < self.H - 4 and 0 <= cx < self.W:
                out.append((label, ck, cx, cy))
        return out

    def render(self, cursor: tuple[int, int] | None) -> bytes:
        W, H = self.W, self.H
        im = Image.new("RGB", (W, H), (255, 255, 255))
        d = ImageDraw.Draw(im)
        off = CHROME_H - self.scroll
        for op, (x0, y0, x1, y1), fill, outline, text, size, tfill, label, _ck in self.items:
            y0s, y1s = y0 + off, y1 + off
            if y1s < CHROME_H or y0s >= H:
                continue
            if op == "button":
                d.rounded_rectangle((x0, y0s, x1, y1s), radius=6, fill=fill)
                _text(im, d, ((x0 + x1) // 2, (y0s + y1s) // 2), text, size, tfill, "mm")
            elif op == "input":
                focused = self.focus == label
                d.rectangle(
                    (x0, y0s, x1, y1s),
                    fill=fill,
                    outline=(66, 133, 244) if focused else outline,
                    width=2 if focused else 1,
                )
                val = self.fields.get(label, text)
                if val:
                    _text(im, d, (x0 + 8, (y0s + y1s) // 2), val, 14, (20, 20, 20), "lm")
                elif not focused:
                    _text(im, d, (x0 + 8, (y0s + y1s) // 2), label, 14, (170, 170, 170), "lm")
                if focused:
                    cx = x0 + 9 + (_textw(val, 14) if val else 0)
                    d.line((cx, y0s + 8, cx, y1s - 8), fill=(0, 0, 0), width=1)
            elif op == "ellipse":
                d.ellipse((x0, y0s, x1, y1s), fill=fill)
            else:
                if fill is not None or outline is not None:
                    d.rectangle((x0, y0s, x1, y1s), fill=fill, outline=outline)
                if text:
                    pad = 16 if op == "rect" else 0
                    _text(im, d, (x0 + pad, y0s + (14 if op == "rect" else 0)), text, size, tfill)
                if op == "link":
                    d.line((x0, y1s, x1, y1s), fill=tfill)
        if self.banner:
            d.rectangle((0, CHROME_H, W, CHROME_H + 36), fill=(220, 245, 225))
            _text(im, d, (16, CHROME_H + 10), self.banner, 14, (20, 100, 40))
        # Browser chrome is drawn last so scrolled content never covers it.
        d.rectangle((0, 0, W, CHROME_H), fill=(222, 225, 230))
        for i, c in enumerate([(237, 106, 94), (245, 191, 79), (98, 197, 84)]):
            d.ellipse((10 + 18 * i, 14, 22 + 18 * i, 26), fill=c)
        d.rounded_rectangle((72, 7, W - 16, CHROME_H - 7), radius=12, fill=(255, 255, 255))
        _text(im, d, (88, CHROME_H // 2), self.url, 13, (60, 60, 60), "lm")
        if self.max_scroll:
            th = max(20, self.view_h * self.view_h // self.height)
            ty = CHROME_H + (self.view_h - th) * self.scroll // self.max_scroll
            d.rectangle((W - 8, ty, W - 2, ty + th), fill=(180, 180, 185))
        if cursor is not None:
            x, y = cursor
            d.polygon(
                [
                    (x, y),
                    (x, y + 18),
                    (x + 5, y + 14),
                    (x + 9, y + 21),
                    (x + 12, y + 19),
                    (x + 8, y + 12),
                    (x + 14, y + 12),
                ],
                fill=(0, 0, 0),
                outline=(255, 255, 255),
            )
        buf = io.BytesIO()
        im.save(buf, "PNG", optimize=False, compress_level=6)
        return buf.getvalue()


def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _image_part(uri: str, bare: bool) -> dict:
    return {"type": "image_url", "image_url": uri if bare else {"url": uri}}


def _call_id(rng: random.Random) -> str:
    return f"call_{rng.getrandbits(96):024x}"


def _slug(s: str) -> str:
    out = "".join(ch.lower() if ch.isalnum() else "-" for ch in s).strip("-")
    return "-".join(p for p in out.split("-") if p)[:40] or "page"


def _page_dump(rng: random.Random, page: _Page, target_chars: int) -> str:
    # Markup and numbers tokenize densely, so this length lands well past an 8k-16k token budget.
    out = [f"Page text of {page.url} (truncated to visible DOM):"]
    n = len(out[0])
    while n < target_chars:
        r = rng.random()
        if r < 0.45:
            s = (
                f"<tr><td>#{rng.randint(10000, 99999)}</td><td>{rng.choice(MONTHS)} {rng.randint(1, 28)}</td>"
                f"<td>{rng.choice(CITIES)}</td><td>${rng.randint(5, 4000)}.{rng.randint(0, 99):02d}</td></tr>"
            )
        elif r < 0.8:
            s = f"<p>{_sentence(rng, 10, 30)} {_sentence(rng, 6, 20)}</p>"
        else:
            s = f'<a href="/{rng.choice(WORDS)}/{rng.randint(1, 9999)}">{_words(rng, rng.randint(2, 5))}</a>'
        out.append(s)
        n += len(s) + 1
    return "\n".join(out)


def _fill(rng: random.Random, template: str, **extra) -> str:
    vals = dict(
        product=rng.choice(PRODUCTS),
        city=rng.choice(CITIES),
        city2=rng.choice(CITIES),
        month=rng.choice(MONTHS),
        day=rng.randint(2, 40),
        word=rng.choice(WORDS),
        word2=rng.choice(WORDS),
        price=f"{rng.randint(9, 899)}.{rng.randint(0, 99):02d}",
        code=f"#{rng.randint(10000, 99999)}",
        hour=rng.randint(5, 22),
        minute=rng.randint(0, 59),
    )
    vals.update(extra)
    return template.format(**vals)


def _hit(i: int, frac: float, phase: float) -> bool:
    # Low-discrepancy selection: floor or ceil of frac*n hits for any n, and record i does not depend on n.
    return int((i + 1) * frac + phase) > int(i * frac + phase)


def _text_only_record(rng: random.Random, overlong: bool) -> list[dict]:
    msgs = [{"role": "system", "content": "You are a helpful assistant."}] if rng.random() < 0.7 else []
    for _ in range(rng.randint(1, 2)):
        q = rng.randrange(len(CHAT_Q))
        msgs.append({"role": "user", "content": _fill(rng, CHAT_Q[q])})
        a = _fill(rng, CHAT_A[q]) + " " + " ".join(_sentence(rng) for _ in range(rng.randint(0, 3)))
        msgs.append({"role": "assistant", "content": a.strip()})
    if overlong:
        msgs[-1]["content"] += "\n\n" + " ".join(_sentence(rng, 10, 30) for _ in range(rng.randint(300, 500)))
    return msgs


def _trace(
    i: int, seed: int, *, text_only: bool, overlong: bool, min_images: int, max_images: int, W: int, H: int
) -> tuple[dict, int]:
    rng = random.Random(f"vlmprep-demo:{seed}:{i}")
    rid = f"trace-{i + 1:06d}"
    if text_only:
        return {"id": rid, "messages": _text_only_record(rng, overlong), "tools": TOOLS}, 0
    bare = rng.random() < BARE_IMAGE_URL_P
    obj_args = rng.random() < OBJECT_ARGS_P
    n_images = rng.randint(min_images, max_images)
    site = rng.choice(SITES)
    query = _words(rng, rng.randint(1, 3))
    ctx = dict(site=site[0])
    task = _fill(rng, rng.choice(TASKS), **ctx)

    def new_page(s, path):
        return _Page(s, rng.choice(s[3]), path, rng.getrandbits(32), W, H, query)

    page = new_page(site, rng.choice(["", "home", "index.html", f"search?q={_slug(query)}"]))
    cursor: tuple[int, int] | None = None
    uri = _data_uri(page.render(cursor))
    messages = [
        {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)},
        {"role": "user", "content": [{"type": "text", "text": task}, _image_part(uri, bare)]},
    ]
    n_steps = n_images - 1
    long_step = rng.randrange(n_steps) if overlong and n_steps else -1
    long_in_assistant = overlong and (n_steps == 0 or rng.random() < 0.3)
    for step in range(n_steps):
        obs = rng.choice(OBSERVE).format(title=page.title, site=page.site[1])
        targets = page.targets()
        inputs = [t for t in targets if t[1] == "input" and t[0] not in page.fields]
        r = rng.random()
        # A no-op step (re-click under the cursor, scroll past an edge) shows the previous screenshot again.
        repeat = rng.random() < REPEAT_P and (cursor is not None or page.scroll in (0, page.max_scroll))
        changed = not repeat
        if repeat and cursor is not None:
            name, args = "click", {"x": cursor[0], "y": cursor[1]}
            intent = rng.choice(INTEND_REPEAT)
            result = f"Clicked at ({args['x']}, {args['y']}). Page: {page.title}"
        elif repeat:
            dy = rng.randint(150, 600) * (-1 if page.scroll == 0 else 1)
            name, args = "scroll", {"dy": dy}
            intent = rng.choice(INTEND_SCROLL if dy > 0 else INTEND_SCROLL_UP)
            result = f"Scrolled by {dy} px. Page: {page.title}"
        elif page.focus is not None and page.focus not in page.fields:
            text = _fill(rng, FIELD_VALUES.get(page.focus, "{word} {word2}"))
            name, args = "type", {"text": text}
            intent = rng.choice(INTEND_TYPE).format(label=page.focus, text=text)
            page.fields[page.focus] = text
            result = f'Typed "{text}" into {page.focus}. Page: {page.title}'
        elif inputs and r < 0.35:
            lab, _, x, y = rng.choice(inputs)
            name, args = "click", {"x": x + rng.randint(-3, 3), "y": y + rng.randint(-2, 2)}
            intent = rng.choice(INTEND_FOCUS).format(label=lab)
            page.focus = lab
            cursor = (args["x"], args["y"])
            result = f"Clicked at ({args['x']}, {args['y']}). Page: {page.title}"
        elif r < 0.6 and page.max_scroll:
            dy = rng.choice([1, 1, 1, -1]) * rng.randint(150, 600)
            dy = -dy if (dy > 0 and page.scroll >= page.max_scroll) or (dy < 0 and page.scroll == 0) else dy
            page.scroll = min(page.max_scroll, max(0, page.scroll + dy))
            name, args = "scroll", {"dy": dy}
            intent = rng.choice(INTEND_SCROLL if dy > 0 else INTEND_SCROLL_UP)
            result = f"Scrolled by {dy} px. Page: {page.title}"
        elif r < 0.68 or not targets:
            s = site if rng.random() < 0.8 else rng.choice(SITES)
            page = new_page(s, f"{rng.choice(WORDS)}/{rng.randint(1, 9999)}")
            name, args = "navigate", {"url": page.url}
            intent = rng.choice(INTEND_NAV).format(url=page.url)
            cursor = None
            result = f"Navigated to {page.url}. Page: {page.title}"
        else:
            lab, kind, x, y = rng.choice(targets)
            name, args = "click", {"x": x + rng.randint(-3, 3), "y": y + rng.randint(-2, 2)}
            intent = rng.choice(INTEND_CLICK).format(label=lab)
            cursor = (args["x"], args["y"])
            if kind == "input":
                page.focus = lab
            else:
                prev = page
                page = new_page(page.site, f"{_slug(lab)}/{rng.randint(1, 999)}")
                if prev.kind == "form" and rng.random() < 0.7:
                    page.banner = f"Thank you! Your request {_fill(rng, '{code}')} was received."
            result = f"Clicked at ({args['x']}, {args['y']}). Page: {page.title}"
        reasoning = " ".join(s for s in (obs if rng.random() < 0.7 else "", intent, rng.choice(PLAN)) if s)
        if step == long_step and long_in_assistant:
            reasoning += "\n\nNotes on the page so far:\n" + _page_dump(rng, page, rng.randint(36000, 60000))
        cid = _call_id(rng)
        arguments = args if obj_args else json.dumps(args)
        messages.append(
            {
                "role": "assistant",
                "content": reasoning,
                "tool_calls": [{"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}],
            }
        )
        if changed:
            uri = _data_uri(page.render(cursor))
        text = result + f" ({page.url})"
        if step == long_step and not long_in_assistant:
            text += "\n" + _page_dump(rng, page, rng.randint(36000, 60000))
        messages.append(
            {"role": "tool", "tool_call_id": cid, "content": [{"type": "text", "text": text}, _image_part(uri, bare)]}
        )
    answer = _fill(rng, rng.choice(ANSWERS), title=page.title, site=page.site[0])
    if long_step < 0 and overlong:
        answer += "\n\n" + _page_dump(rng, page, rng.randint(36000, 60000))
    messages.append({"role": "assistant", "content": answer})
    return {"id": rid, "messages": messages, "tools": TOOLS}, n_images


def _check(n, min_images, max_images, text_only_fraction, overlong_fraction, width, height):
    if n < 0:
        raise ValueError("n must be >= 0")
    if not 1 <= min_images <= max_images:
        raise ValueError("need 1 <= min_images <= max_images")
    for f in (text_only_fraction, overlong_fraction):
        if not 0.0 <= f <= 1.0:
            raise ValueError("fractions must be within [0, 1]")
    if width < 160 or height < CHROME_H + 24:
        raise ValueError(f"image size must be at least 160x{CHROME_H + 24}")


def _generate(*, n, seed, min_images, max_images, text_only_fraction, overlong_fraction, width, height):
    _check(n, min_images, max_images, text_only_fraction, overlong_fraction, width, height)
    phases = random.Random(f"vlmprep-demo-phase:{seed}")
    p_text, p_long = phases.random(), phases.random()
    for i in range(n):
        yield _trace(
            i,
            seed,
            text_only=_hit(i, text_only_fraction, p_text),
            overlong=_hit(i, overlong_fraction, p_long),
            min_images=min_images,
            max_images=max_images,
            W=width,
            H=height,
        )


def generate_traces(
    *,
    n: int,
    seed: int = 0,
    min_images: int = 2,
    max_images: int = 25,
    text_only_fraction: float = 0.05,
    overlong_fraction: float = 0.03,
    width: int = 1280,
    height: int = 720,
) -> Iterator[dict]:
    """Yield n browser-agent trace records; record i depends only on (seed, i) and the other arguments."""
    for rec, _ in _generate(
        n=n,
        seed=seed,
        min_images=min_images,
        max_images=max_images,
        text_only_fraction=text_only_fraction,
        overlong_fraction=overlong_fraction,
        width=width,
        height=height,
    ):
        yield rec


def write_traces(path: Path, *, id_prefix: str = "trace", **options) -> dict:
    """Write generate_traces(**options) as .jsonl.zst atomically; return {"records", "images", "bytes"}. Ids are
    ID_PREFIX-000001 ...: parts of one corpus need distinct prefixes (a build rejects duplicate ids)."""
    given = inspect.signature(generate_traces).bind(**options)  # its options and defaults, as a call would take them
    given.apply_defaults()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    records = images = 0
    try:
        with open(tmp, "wb") as f:
            with zstandard.ZstdCompressor(level=3).stream_writer(f, closefd=False) as w:
                for rec, k in _generate(**given.arguments):
                    rec = {**rec, "id": id_prefix + rec["id"].removeprefix("trace")}
                    w.write(json.dumps(rec, ensure_ascii=True, separators=(",", ":")).encode("ascii") + b"\n")
                    records += 1
                    images += k
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {"records": records, "images": images, "bytes": path.stat().st_size}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m scripts.demo_traces", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-images", type=int, default=2)
    ap.add_argument("--max-images", type=int, default=25)
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--height", type=int, default=720)
    ap.add_argument("--id-prefix", default="trace", help="ids are PREFIX-000001 ... (distinct per part of a corpus)")
    a = ap.parse_args(argv)
    stats = write_traces(
        a.out,
        n=a.n,
        seed=a.seed,
        min_images=a.min_images,
        max_images=a.max_images,
        width=a.width,
        height=a.height,
        id_prefix=a.id_prefix,
    )
    print(json.dumps({"out": str(a.out), **stats}))


if __name__ == "__main__":
    main()
