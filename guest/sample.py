#!/usr/bin/env python3
"""Takes pages of a real process's memory for the workload guest's fill=real.

A Python process does an ordinary day's work (imports a dozen standard modules, parses text
into dictionaries, fills an SQLite database in memory, compiles regular expressions) and
waits; this script reads every mapping of it through /proc/PID/mem (code, libraries, heap,
stacks, anonymous memory), keeps the pages that are not all zero and writes PAGES of them,
evenly spaced, to OUT. Zero pages are left out: in the guest, untouched memory is the zero
part. Address-space randomisation is off and the hash seed fixed, so the sample is the same
from one build to the next on the same system but for a few pages (stack canaries, times)
that differ in a few bytes. Prints the sample's make-up and how far
zstd and lz4 shrink it.

usage: sample.py OUT
"""
import os
import subprocess
import sys

PAGES = 1024
PAGE = 4096

WORK = r"""
import argparse, asyncio, collections, csv, decimal, email.parser, glob, http.client, io
import json, re, sqlite3, unittest, xml.etree.ElementTree as ET
words = collections.Counter()
texts = []
for path in sorted(glob.glob('/usr/share/common-licenses/*'))[:12]:
    try:
        text = open(path, encoding='utf-8', errors='replace').read()
    except OSError:
        continue
    texts.append(text)
    words.update(re.findall(r'[A-Za-z]+', text))
db = sqlite3.connect(':memory:')
db.execute('create table w (word text, n integer, len integer)')
db.executemany('insert into w values (?, ?, ?)', ((w, n, len(w)) for w, n in words.items()))
rows = db.execute('select word, n from w order by n desc').fetchall()
index = {w: [i for i, t in enumerate(texts) if w in t] for w, _ in rows[:2000]}
records = [{'id': i, 'word': w, 'n': n, 'price': decimal.Decimal(n) / 7} for i, (w, n) in enumerate(rows)]
blob = json.dumps([{k: str(v) for k, v in r.items()} for r in records])
tree = ET.fromstring('<r>' + ''.join('<w n="%d">%s</w>' % (n, w) for w, n in rows[:5000]) + '</r>')
patterns = [re.compile(r'\b%s\w*' % w) for w, _ in rows[:300]]
print('ready', flush=True)
input()
"""


def nonzero_pages(pid):
    """The pages of the process's readable mappings that hold something other than zeros."""
    pages = []
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for line in maps:
            fields = line.split()
            if "r" not in fields[1] or fields[-1] in ("[vvar]", "[vsyscall]"):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            for at in range(start, end, PAGE):
                try:
                    mem.seek(at)
                    page = mem.read(PAGE)
                except OSError:
                    continue
                if len(page) == PAGE and page.count(0) != PAGE:
                    pages.append(page)
                elif len(page) == PAGE:
                    pages.append(None)
    return pages


def ratio(tool, data):
    """How far `tool` shrinks `data`, in words ("2.94x"); the sample is made without it."""
    try:
        packed = subprocess.run(tool, input=data, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        return f"unknown ({tool[0]}: {e})"
    return f"{len(data) / len(packed):.2f}x"


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    env = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "LANG": "C.UTF-8"}
    proc = subprocess.Popen(["setarch", "-R", sys.executable, "-c", WORK], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if proc.stdout.readline().strip() != "ready":
            sys.exit("sample.py: the sampled process did not get ready")
        pages = nonzero_pages(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    data = [p for p in pages if p is not None]
    if len(data) < PAGES:
        sys.exit(f"sample.py: only {len(data)} pages hold data, {PAGES} wanted")
    chosen = b"".join(data[i * len(data) // PAGES] for i in range(PAGES))
    with open(sys.argv[1], "wb") as out:
        out.write(chosen)
    print(f"sample.py: {PAGES} of {len(data)} data pages ({len(pages) - len(data)} zero "
          f"pages left out); zstd -3 {ratio(['zstd', '-3', '-c'], chosen)}, "
          f"lz4 {ratio(['lz4', '-c'], chosen)}")


if __name__ == "__main__":
    main()
