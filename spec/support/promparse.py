"""Parses Prometheus text exposition format from stdin with prometheus_client's
parser (PyPI; spec/support/setup.sh prometheus) and prints it as one JSON
document: a list of families, each {name, type, help, samples: [{name,
labels, value}]} (values as strings, so +Inf and NaN survive JSON).

The parser is lenient, so this also checks what it lets through: every
line is a comment or a sample, no family's HELP or TYPE comes twice or
after its samples, sample names belong to the family last declared, and a
histogram's buckets are cumulative and end in le="+Inf" equal to _count.
Any violation (or a parse error) exits 1 with the reason on stderr."""
import json
import math
import re
import sys

from prometheus_client.parser import text_string_to_metric_families

SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{.*\})? \S+$')


def fail(msg):
    sys.stderr.write("promparse: %s\n" % msg)
    sys.exit(1)


def check_lines(text):
    if text and not text.endswith("\n"):
        fail("the exposition does not end in a newline")
    declared, current = set(), None
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            kind, name = line[2:6], line.split(" ")[2]
            if (kind, name) in declared:
                fail("%s of %s twice" % (kind, name))
            if current != name and any(n == name for _, n in declared):
                fail("%s of %s after other families" % (kind, name))
            declared.add((kind, name))
            current = name
        elif not SAMPLE.match(line):
            fail("not a sample line: %r" % line)
        elif current is None or not line.startswith(current.removesuffix("_total")):
            fail("sample %r outside its family (%s)" % (line, current))


def check_histogram(fam):
    series = {}
    for s in fam.samples:
        labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
        series.setdefault(labels, []).append(s)
    for labels, samples in series.items():
        buckets = [s for s in samples if s.name.endswith("_bucket")]
        count = [s.value for s in samples if s.name.endswith("_count")]
        if not buckets or buckets[-1].labels["le"] != "+Inf":
            fail("%s%s: no +Inf bucket last" % (fam.name, labels))
        values = [b.value for b in buckets]
        if values != sorted(values):
            fail("%s%s: buckets not cumulative" % (fam.name, labels))
        bounds = [float(b.labels["le"]) for b in buckets]
        if bounds != sorted(bounds):
            fail("%s%s: bounds not increasing" % (fam.name, labels))
        if count != [values[-1]]:
            fail("%s%s: _count %s is not the +Inf bucket %s" % (fam.name, labels, count,
                                                                  values[-1]))


def value(v):
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v)


def main():
    text = sys.stdin.read()
    check_lines(text)
    out = []
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as e:  # the parser raises ValueError and others
        fail("prometheus_client cannot parse it: %r" % e)
    for fam in families:
        if fam.type == "histogram":
            check_histogram(fam)
        out.append({"name": fam.name, "type": fam.type, "help": fam.documentation,
                    "samples": [{"name": s.name, "labels": s.labels, "value": value(s.value)}
                                for s in fam.samples]})
    json.dump(out, sys.stdout)


main()
