#!/usr/bin/env python3
"""Checks that the docs stay true to the tree (run by CTest, label docs).

    check_docs.py links ROOT
        Every relative link in ROOT/README.md and ROOT/docs/*.md names a file
        that exists, every #anchor a heading of that file (GitHub's slugs),
        no link leaves the repository, and no text cites an issue number
        (the docs say what is, not how it came to be).
    check_docs.py names ROOT REDUCER BENCH
        docs/configuration.md names every TALLY_* variable the code reads
        (a quoted "TALLY_..." in client/, reducer/, bench/, protocol/,
        examples/, deploy/, or $ENV{TALLY_...} in a .cmake script there) or a
        CMake option of the build, and every flag in the --help of tally-reducer and
        of tally-bench and its subcommands; and every TALLY_* name it gives
        exists in the code.
    check_docs.py planted ROOT
        The link check fails on a copy of the docs with a broken link and a
        broken anchor planted in it, naming both (the check can fail).

Exit 0 when all holds, 1 with one line per finding otherwise."""

import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
ENV_NAME = re.compile(r"\bTALLY_[A-Z0-9_]*[A-Z0-9]\b")
QUOTED_ENV_NAME = re.compile(r"""["'](TALLY_[A-Z0-9_]*[A-Z0-9])["']""")
CMAKE_OPTION = re.compile(r"option\((TALLY_\w+)|set\((TALLY_\w+)[^\n]*CACHE (?!INTERNAL)")
CMAKE_ENV = re.compile(r"\$ENV\{(TALLY_\w+)\}")
ISSUE = re.compile(r"\bissues?[ -]#?[0-9]+", re.I)
FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")


def doc_files(root):
    return [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "*.md")))


def prose(text):
    """The text outside fenced code blocks and code spans."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path):
    found, seen = set(), {}
    for m in HEADING.finditer(FENCE.sub("", open(path, encoding="utf-8").read())):
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else "%s-%d" % (base, n))
    return found


def check_links(root):
    findings = []
    for doc in doc_files(root):
        text = prose(open(doc, encoding="utf-8").read())
        where = os.path.relpath(doc, root)
        for m in ISSUE.finditer(text):
            findings.append("%s: cites %r" % (where, m.group(0)))
        for m in LINK.finditer(text):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                findings.append("%s: %s leaves the repository" % (where, target))
                continue
            path, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
            if not os.path.exists(resolved):
                findings.append(
                    "%s: %s names no file (%s)" % (where, target, os.path.relpath(resolved, root))
                )
            elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
                findings.append(
                    "%s: %s names no heading of %s"
                    % (where, target, os.path.relpath(resolved, root))
                )
    return findings


def code_env_names(root):
    dirs = ["client", "reducer", "bench", "protocol", "examples", "deploy", "*CMakeLists.txt"]
    listed = subprocess.check_output(["git", "-C", root, "ls-files"] + dirs, text=True).split()
    names = set()
    for rel in listed:
        with open(os.path.join(root, rel), errors="ignore") as f:
            text = f.read()
        if rel.endswith((".cc", ".h", ".c", ".py", ".sh")):
            names.update(QUOTED_ENV_NAME.findall(text))
        elif os.path.basename(rel) == "CMakeLists.txt":
            names.update(a or b for a, b in CMAKE_OPTION.findall(text))
        elif rel.endswith(".cmake"):
            names.update(CMAKE_ENV.findall(text))
    return names


def help_flags(command):
    r = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise SystemExit("%s exited %d: %s" % (" ".join(command), r.returncode, r.stderr[-500:]))
    return set(FLAG.findall(r.stdout)) - {"--help"}


def check_names(root, reducer, bench):
    config = open(os.path.join(root, "docs", "configuration.md"), encoding="utf-8").read()
    documented = set(ENV_NAME.findall(config))
    read = code_env_names(root)
    findings = [
        "docs/configuration.md does not name %s, which the code reads" % n
        for n in sorted(read - documented)
    ]
    findings += [
        "docs/configuration.md names %s, which no code reads" % n for n in sorted(documented - read)
    ]
    config_flags = set(FLAG.findall(config))
    for command in (
        [reducer, "--help"],
        [bench, "--help"],
        [bench, "run", "--help"],
        [bench, "load", "--help"],
        [bench, "chaos", "--help"],
    ):
        for flag in sorted(help_flags(command) - config_flags):
            findings.append(
                "docs/configuration.md does not name %s of `%s`"
                % (flag, " ".join([os.path.basename(command[0])] + command[1:]))
            )
    return findings


def check_planted(root):
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(os.path.join(root, "README.md"), tmp)
        shutil.copytree(os.path.join(root, "docs"), os.path.join(tmp, "docs"))
        with open(os.path.join(tmp, "docs", "operations.md"), "a") as f:
            f.write(
                "\nSee [gone](no-such-page.md) and [the void](configuration.md#no-such-part).\n"
            )
        findings = check_links(tmp)
    want = [
        "docs/operations.md: no-such-page.md names no file",
        "docs/operations.md: configuration.md#no-such-part names no heading",
    ]
    missed = [w for w in want if not any(f.startswith(w) for f in findings)]
    if len(findings) != len(want) or missed:
        return ["the planted links were not found as they should be: got %r" % findings]
    return []


def main(argv):
    if len(argv) >= 2 and argv[0] == "links":
        findings = check_links(argv[1])
    elif len(argv) == 4 and argv[0] == "names":
        findings = check_names(*argv[1:])
    elif len(argv) == 2 and argv[0] == "planted":
        findings = check_planted(argv[1])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    for line in findings:
        print(line)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
