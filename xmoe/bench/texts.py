"""Long public-domain text for haystacks: the King James Bible from Debian's `bible-kjv` package when its
`bible` command is installed (about 1M tokens), else the license texts every Debian system carries (about
70K tokens), else a file the user names."""
import shutil
import subprocess
import sys
from pathlib import Path

from .data import cache_dir

LICENSES = Path("/usr/share/common-licenses")
APT_HINT = "apt-get install -y bible-kjv"


def kjv() -> str | None:
    """The whole KJV as text (cached after the first extraction), or None without the `bible` command."""
    cached = cache_dir() / "kjv.txt"
    if cached.is_file():
        return cached.read_text()
    if not shutil.which("bible"):
        return None
    r = subprocess.run(["bible", "Gen1:1-Rev22:21"], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if r.returncode or len(r.stdout) < 1_000_000:
        return None
    cached.write_text(r.stdout)
    return r.stdout


def licenses() -> str | None:
    files = sorted(p for p in LICENSES.glob("*") if p.is_file()) if LICENSES.is_dir() else []
    return "\n\n".join(p.read_text(errors="replace") for p in files) or None


def long_text(path: str | None = None, quiet: bool = False) -> tuple[str, str]:
    """(text, where it came from). A named file wins; then the KJV; then the license texts."""
    if path:
        return Path(path).read_text(errors="replace"), path
    text = kjv()
    if text:
        return text, "KJV (Debian bible-kjv)"
    text = licenses()
    if text:
        if not quiet:
            print(f"note: the KJV text is not available ({APT_HINT}); using the license texts in {LICENSES} "
                  f"({len(text):,} characters)", file=sys.stderr)
        return text, f"{LICENSES}/*"
    raise OSError(f"no long text found: install the KJV ({APT_HINT}) or pass --text FILE")

