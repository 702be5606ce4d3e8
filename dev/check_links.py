#!/usr/bin/env python3
"""Every relative link of the repository's markdown pages resolves: the file exists and, for a #fragment into a
markdown page, a heading of that page makes that anchor (as GitHub makes them). Prints each broken link and exits 1
if any; run from the repository's root (a CTest case runs it)."""
import re
import subprocess
import sys
from pathlib import Path

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set:
    found, seen = set(), {}
    in_code = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        text = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def main() -> int:
    pages = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "*.md"], capture_output=True, text=True,
                           check=True).stdout.split()
    broken = []
    for name in pages:
        page = Path(name)
        if not page.exists():
            continue
        in_code = False
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if line.startswith("```"):
                in_code = not in_code
            if in_code:
                continue
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):
                    continue  # https:, mailto:
                path, _, fragment = target.partition("#")
                dest = page if not path else (page.parent / path)
                if not dest.exists():
                    broken.append(f"{name}:{number}: {target}: no such file")
                elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                    broken.append(f"{name}:{number}: {target}: no heading makes #{fragment}")
    for b in broken:
        print(b)
    print(f"{len(pages)} pages: {len(broken)} broken links" if broken else f"{len(pages)} pages: every relative link resolves")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
