"""Make the `geometry3k` env's shipped sample: 24 train and 8 test diagram problems.

Writes, in geometry3k's format as distributed for VLM RL (rows of `problem` with an
`<image>` marker, `answer`, `images`): `<out>/{train,test}.jsonl` and
`<out>/images/<split>-NNN.png` (224x224 greyscale PNGs of a few KB). The problems are
right triangles (a missing side, a missing angle), triangles (the third angle),
rectangles (area) and circles (circumference, area); every answer is exact ("5",
"2\\sqrt{3}", "10\\pi"). Deterministic: the same seed gives the same problems.

Run: `python scripts/make_geometry3k_sample.py [--out DIR] [--seed N]`
(default out: services/envhost/envs/data/geometry3k).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

SIZE = 224
N_TRAIN, N_TEST = 24, 8
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "services/envhost/envs/data/geometry3k"


def sqrt_latex(n: int) -> str:
    """sqrt(n) in simplest radical form: 25 -> "5", 12 -> "2\\sqrt{3}", 7 -> "\\sqrt{7}"."""
    k, m = 1, n
    for f in range(int(math.isqrt(n)), 1, -1):
        if n % (f * f) == 0:
            k, m = f, n // (f * f)
            break
    if m == 1:
        return str(k)
    return (f"{k}" if k > 1 else "") + f"\\sqrt{{{m}}}"


class Canvas:
    def __init__(self) -> None:
        self.img = Image.new("L", (SIZE, SIZE), 255)
        self.d = ImageDraw.Draw(self.img)
        self.font = ImageFont.load_default(size=16)

    def label(self, xy: tuple[float, float], text: str) -> None:
        self.d.text(xy, text, font=self.font, fill=0, anchor="mm")

    def line(self, *pts: tuple[float, float]) -> None:
        self.d.line(pts, fill=0, width=2)


def inside(v: tuple[float, float], p: tuple[float, float], q: tuple[float, float],
           dist: float) -> tuple[float, float]:
    """The point `dist` pixels from vertex `v` along its angle's bisector (towards the
    sides vp and vq): where the angle's label goes."""
    ux, uy = p[0] - v[0], p[1] - v[1]
    wx, wy = q[0] - v[0], q[1] - v[1]
    nu, nw = math.hypot(ux, uy), math.hypot(wx, wy)
    bx, by = ux / nu + wx / nw, uy / nu + wy / nw
    nb = math.hypot(bx, by)
    return v[0] + dist * bx / nb, v[1] + dist * by / nb


def right_triangle(legs: tuple[float, float], labels: tuple[str, str, str],
                   angle_b: str = "", angle_c: str = "") -> Image.Image:
    """A right triangle, right angle bottom-left; `labels`: (horizontal leg, vertical
    leg, hypotenuse), "" for none; `angle_b`/`angle_c`: the angle labels at the
    bottom-right and the top vertex."""
    c = Canvas()
    a, b = legs
    s = 150 / max(a, b)
    x0, y0 = 40, 185
    A, B, C = (x0, y0), (x0 + a * s, y0), (x0, y0 - b * s)
    c.line(A, B, C, A)
    c.line((x0, y0 - 12), (x0 + 12, y0 - 12), (x0 + 12, y0))  # right-angle mark
    horiz, vert, hyp = labels
    if horiz:
        c.label(((A[0] + B[0]) / 2, y0 + 16), horiz)
    if vert:
        c.label((x0 - 18, (A[1] + C[1]) / 2), vert)
    if hyp:
        c.label(((B[0] + C[0]) / 2 + 14, (B[1] + C[1]) / 2 - 10), hyp)
    at_b = math.degrees(math.atan2(b, a))  # the angle at B
    if angle_b:
        c.d.arc((B[0] - 26, y0 - 26, B[0] + 26, y0 + 26), 180, 180 + at_b, fill=0)
        c.label(inside(B, A, C, 44), angle_b)
    if angle_c:
        c.d.arc((x0 - 26, C[1] - 26, x0 + 26, C[1] + 26), at_b, 90, fill=0)
        c.label(inside(C, A, B, 44), angle_c)
    return c.img


def triangle(angles: tuple[str, str, str]) -> Image.Image:
    """A scalene triangle with an angle label inside each corner."""
    c = Canvas()
    A, B, C = (30, 180), (195, 180), (80, 45)
    c.line(A, B, C, A)
    c.label((A[0] + 30, A[1] - 14), angles[0])
    c.label((B[0] - 38, B[1] - 12), angles[1])
    c.label((C[0] + 4, C[1] + 34), angles[2])
    return c.img


def rectangle(w: int, h: int) -> Image.Image:
    c = Canvas()
    s = 140 / max(w, h)
    x0, y0 = (SIZE - w * s) / 2, (SIZE - h * s) / 2
    c.d.rectangle((x0, y0, x0 + w * s, y0 + h * s), outline=0, width=2)
    c.label((SIZE / 2, y0 + h * s + 14), str(w))
    c.label((x0 - 16, SIZE / 2), str(h))
    return c.img


def circle(r: int) -> Image.Image:
    c = Canvas()
    m, R = SIZE / 2, 80
    c.d.ellipse((m - R, m - R, m + R, m + R), outline=0, width=2)
    c.d.ellipse((m - 3, m - 3, m + 3, m + 3), fill=0)
    c.line((m, m), (m + R, m))
    c.label((m + R / 2, m - 12), str(r))
    return c.img


def problems(rng: random.Random) -> list[tuple[str, str, str, Image.Image]]:
    """(kind, problem, answer, diagram) for every candidate; no two share a diagram."""
    out = []
    for a, b in [(3, 4), (5, 12), (6, 8), (8, 15), (2, 2), (2, 4), (3, 6), (1, 3), (7, 24)]:
        out.append(("hypotenuse", "<image>Find x.", sqrt_latex(a * a + b * b),
                    right_triangle((a, b), (str(a), str(b), "x"))))
    for c, a in [(13, 5), (10, 6), (17, 8), (4, 2), (6, 3), (25, 7), (9, 3)]:
        out.append(("leg", "<image>Find x.", sqrt_latex(c * c - a * a),
                    right_triangle((a, math.sqrt(c * c - a * a)), (str(a), "x", str(c)))))
    for short, ang in [(4, 30), (5, 30), (7, 30)]:
        out.append(("angle", "<image>Find x.", str(ang),
                    right_triangle((short * math.sqrt(3), short), ("", str(short), str(2 * short)), "x°")))
    for y in (35, 52, 64, 27):
        out.append(("complement", "<image>Find x.", str(90 - y),
                    right_triangle((math.tan(math.radians(y)), 1), ("", "", ""), "x°", f"{y}°")))
    for p, q in [(50, 60), (45, 75), (38, 81), (64, 29)]:
        out.append(("triangle", "<image>Find x.", str(180 - p - q), triangle((f"{p}°", f"{q}°", "x°"))))
    for w, h in [(7, 4), (9, 5), (12, 3), (6, 11)]:
        out.append(("area", "<image>Find the area of the rectangle.", str(w * h), rectangle(w, h)))
    for r in (3, 5, 8):
        out.append(("circumference", "<image>Find the circumference of the circle. Give the exact "
                    "answer in terms of \\pi.", f"{2 * r}\\pi", circle(r)))
    for r in (4, 6):
        out.append(("circle-area", "<image>Find the area of the circle. Give the exact answer in "
                    "terms of \\pi.", f"{r * r}\\pi", circle(r)))
    rng.shuffle(out)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--seed", type=int, default=3)
    args = p.parse_args(argv)
    rows = problems(random.Random(args.seed))
    # the test split has one problem of each kind, the first of that kind drawn
    kinds = list(dict.fromkeys(kind for kind, *_ in rows))
    assert len(kinds) == N_TEST
    test = {next(i for i, r in enumerate(rows) if r[0] == k) for k in kinds}
    splits = {"train": [r for i, r in enumerate(rows) if i not in test][:N_TRAIN],
              "test": [rows[i] for i in sorted(test)]}
    (args.out / "images").mkdir(parents=True, exist_ok=True)
    for split, items in splits.items():
        with open(args.out / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for n, (_, problem, answer, img) in enumerate(items):
                rel = f"images/{split}-{n:03d}.png"
                img.save(args.out / rel, format="PNG", optimize=True)
                f.write(json.dumps({"problem": problem, "answer": answer, "images": [rel]}) + "\n")
        print(f"{split}: {len(items)} problems")


if __name__ == "__main__":
    main()
