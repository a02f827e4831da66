"""Turn access-log lines into records and summarise them.

Expected line shape (one request per line)::

    10.0.4.17 - alice [2024-03-09T14:02:51] "GET /a?p=2 HTTP/1.1" 200 512 31ms
"""

import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import datetime
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

LINE_RE = re.compile(
    r'^(?P<ip>\d{1,3}(?:\.\d{1,3}){3})\s+-\s+(?P<user>\S+)\s+'
    r'\[(?P<ts>[^\]]+)\]\s+'
    r'"(?P<method>[A-Z]+)\s+(?P<path>\S+)\s+HTTP/(?P<proto>[\d.]+)"\s+'
    r'(?P<status>\d{3})\s+(?P<size>\d+|-)'
    r'(?:\s+(?P<elapsed>\d+)ms)?\s*$'
)
TS_FORMAT = "%Y-%m-%dT%H:%M:%S"


@dataclass
class Request:
    ip: str
    user: Optional[str]
    when: datetime
    method: str
    path: str
    status: int
    size: int
    elapsed_ms: Optional[int]

    @property
    def hour_key(self) -> str:
        return self.when.strftime("%Y-%m-%d %H:00")


def parse_line(line: str) -> Optional[Request]:
    """Return a :class:`Request`, or None when the line does not fit."""
    match = LINE_RE.match(line.strip())
    if match is None:
        return None
    try:
        when = datetime.strptime(match["ts"], TS_FORMAT)
    except ValueError:
        return None
    user = match["user"]
    size = match["size"]
    elapsed = match["elapsed"]
    return Request(
        ip=match["ip"],
        user=None if user == "-" else user,
        when=when,
        method=match["method"],
        path=match["path"].split("?", 1)[0],
        status=int(match["status"]),
        size=0 if size == "-" else int(size),
        elapsed_ms=int(elapsed) if elapsed else None,
    )


def split_lines(lines: Iterable[str]) -> Tuple[List[Request],
                                               List[Tuple[int, str]]]:
    good: List[Request] = []
    bad: List[Tuple[int, str]] = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        record = parse_line(raw)
        if record is None:
            bad.append((number, raw.rstrip("\n")))
        else:
            good.append(record)
    return good, bad


def malformed(lines: Iterable[str]) -> Iterator[Tuple[int, str]]:
    """Lazily yield (line number, text) for lines that fail to parse."""
    for number, raw in enumerate(lines, start=1):
        if raw.strip() and parse_line(raw) is None:
            yield number, raw.rstrip("\n")


def status_counts(records: Iterable[Request]) -> Counter:
    return Counter(r.status for r in records)


def hourly_counts(records: Iterable[Request]) -> Dict[str, Counter]:
    """Map each hour to a Counter of status classes such as '2xx'."""
    buckets: Dict[str, Counter] = defaultdict(Counter)
    for rec in records:
        buckets[rec.hour_key][f"{rec.status // 100}xx"] += 1
    return dict(sorted(buckets.items()))


def slowest_paths(records: Iterable[Request], top: int = 5):
    timings: Dict[str, List[int]] = defaultdict(list)
    for rec in records:
        if rec.elapsed_ms is not None:
            timings[rec.path].append(rec.elapsed_ms)
    averages = {p: sum(v) / len(v) for p, v in timings.items()}
    return sorted(averages.items(), key=lambda kv: kv[1], reverse=True)[:top]


def format_report(records: List[Request],
                  bad: List[Tuple[int, str]]) -> str:
    out = [f"requests parsed: {len(records)}",
           f"malformed lines: {len(bad)}", "", "status codes:"]
    for code, n in sorted(status_counts(records).items()):
        share = 100.0 * n / len(records) if records else 0.0
        out.append(f"  {code}  {n:>7}  {share:5.1f}%")
    out += ["", "per hour:"]
    for hour, counts in hourly_counts(records).items():
        detail = " ".join(f"{k}={v}" for k, v in sorted(counts.items()))
        out.append(f"  {hour}  {detail}")
    slow = slowest_paths(records)
    if slow:
        out += ["", "slowest paths (mean ms):"]
        out.extend(f"  {ms:8.1f}  {path}" for path, ms in slow)
    return "\n".join(out)
