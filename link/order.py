#!/usr/bin/env python3
"""Writes link/symbol-order.txt: the functions a release `dsh` runs.

The linker puts the functions named there first in the binary's code, side
by side (build.rs), so a process touches a few MB of code instead of pages
spread over 35 MB. The names are the linker's own for this build, so the
traces come from the very binary whose map is read:

    DSH_LINK_MAP=/tmp/dsh.map cargo build --release --bin dsh
    link/trace.sh target/release/dsh /tmp/dsh-traces   # callgrind runs
    link/order.py /tmp/dsh.map /tmp/dsh-traces/callgrind.{w1,w2,w3,demo,run,acp}.* \\
        > link/symbol-order.txt

(`link/regen.sh` does all of it, and builds again with the new list.)
Functions come in the order of the traces given (W1's first), so the paths
that matter most share the fewest pages.

A stripped binary has no symbols, so callgrind names its functions by
address; this maps each address to the code section that holds it.
"""

import bisect
import re
import sys

SECTION = re.compile(
    r"\s*([0-9a-f]+)\s+[0-9a-f]+\s+([0-9a-f]+)\s+\d+\s+\S*?:\(\.text\.(\S+)\)$"
)
PREFIX = re.compile(r"^(unlikely|hot|startup|exit|split)[.]")
NAMED = re.compile(r"^(c?)(ob|fn)=\((\d+)\)(?: (.*))?$")


def sections(map_path):
    """(start, end, symbol) of every function section, sorted by start."""
    found = []
    with open(map_path, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = SECTION.match(line)
            if m and int(m.group(2), 16) > 0:
                start = int(m.group(1), 16)
                found.append((start, start + int(m.group(2), 16), m.group(3)))
    found.sort()
    return found


def addresses(trace_path, binary):
    """Addresses of the instructions callgrind saw run in `binary`, in the
    order the trace lists them (`--dump-instr=yes`: a cost line starts with
    its instruction's address, absolute or relative to the last one)."""
    objects, functions = {}, {}
    seen = {}
    current_ob = ""
    last = 0
    with open(trace_path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if line.startswith("positions:") and line.split()[1:] != ["instr"]:
                sys.exit(
                    f"{trace_path}: positions are {line[10:].strip()}; "
                    "trace with --dump-instr=yes --dump-line=no"
                )
            m = NAMED.match(line)
            if m:
                called, kind, ident, name = m.groups()
                table = objects if kind == "ob" else functions
                if name is not None:
                    table[ident] = name
                if kind == "ob" and not called:
                    current_ob = table.get(ident, "")
                continue
            head = line.split(" ", 1)[0]
            if head.startswith("0x"):
                last = int(head, 16)
            elif head[:1] in "+-" and head[1:].isdigit():
                last += int(head)
            elif head != "*":
                continue
            if current_ob.endswith(binary):
                seen.setdefault(last, None)
    return list(seen)


def main():
    if len(sys.argv) < 3:
        sys.exit("usage: order.py MAP CALLGRIND_OUT... (writes symbol names to stdout)")
    table = sections(sys.argv[1])
    if not table:
        sys.exit(f"{sys.argv[1]}: no function sections in this linker map")
    starts = [s for s, _, _ in table]
    hit = {}
    for path in sys.argv[2:]:
        for addr in addresses(path, "/dsh"):
            i = bisect.bisect_right(starts, addr) - 1
            if i >= 0 and addr < table[i][1]:
                hit.setdefault(i, table[i])
    total = sum(end - start for start, end, _ in hit.values())
    print(f"order.py: {len(hit)} functions, {total} bytes of code", file=sys.stderr)
    if not hit:
        sys.exit("order.py: the traces ran none of the map's functions (another build's map?)")
    for _, _, section in hit.values():
        # A compiler's section prefixes (GCC's and LLVM's) are not part of
        # the symbol's name.
        print(PREFIX.sub("", section))


if __name__ == "__main__":
    main()
