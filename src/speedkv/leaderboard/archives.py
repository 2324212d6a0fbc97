"""A board's archived answers (benchmarks/ruler/MODEL-LENGTH/answers/): every part's answers so
far, gzipped beside the board, so a sweep resumes on another machine and a render pairs the
samples of rows whose runs are not here.

A kvpress part resumes from its raw answers, but a board reads its records, and writing those
takes the kvpress environment (its versions) and the RULER samples (their references): so its
records are archived beside its raw answers whenever they are up to date with them, and a
render from the archive alone (a fresh checkout) needs neither."""

from __future__ import annotations

import gzip
import sys
from pathlib import Path


def resume_file(part: Path) -> Path:
    """What a stopped part resumes from: kvpress's raw answers, or speedkv eval's records."""
    raw = part / "kvpress-results.jsonl"
    return raw if part.name.startswith(("kvpress-", "kvzip-")) else part / "records.jsonl"


def archived(board: Path, part: Path) -> Path:
    return board / "answers" / f"{part.name}.{resume_file(part).name}.gz"


def archived_records(board: Path, part: Path) -> Path | None:
    """Where a kvpress part's records are archived (None for speedkv's: its records are what
    it resumes from)."""
    if resume_file(part).name == "records.jsonl":
        return None
    return board / "answers" / f"{part.name}.records.jsonl.gz"


def _write_gzip(target: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(target, "wb", mtime=0) as sink:
        sink.write(data)


def archive_records(board: Path, part: Path) -> Path | None:
    """Archive a kvpress part's records where they describe exactly the answers archived for it
    (written after its answers, which equal the archive's); drop an archived copy that does
    not. Returns the file written, if any."""
    target, records = archived_records(board, part), part / "records.jsonl"
    if target is None:
        return None
    answers, archive = resume_file(part), archived(board, part)
    current = (
        records.exists()
        and records.stat().st_mtime >= answers.stat().st_mtime
        and archive.exists()
        and gzip.decompress(archive.read_bytes()) == answers.read_bytes()
    )
    if not current:
        return None
    data = records.read_bytes()
    if target.exists() and gzip.decompress(target.read_bytes()) == data:
        return None
    _write_gzip(target, data)
    return target


def archive_answers(work: Path, board: Path) -> list[Path]:
    """Copy every part's answers so far into the board's folder (gzip, no timestamp, so an
    unchanged part gives the same bytes): a sweep stopped here resumes from them on another
    machine; a kvpress part's records too, where they are up to date (archive_records).
    Returns the files written."""
    written = []
    for part in sorted(p for p in work.glob("*-*of*") if p.is_dir()):
        source = resume_file(part)
        if not source.exists():
            continue
        target = archived(board, part)
        answers = source.read_bytes()
        if not (target.exists() and gzip.decompress(target.read_bytes()).startswith(answers)):
            _write_gzip(target, answers)  # else the archive holds all of this copy already
            written.append(target)
            stale = archived_records(board, part)
            if stale is not None and stale.exists():
                stale.unlink()  # made from other answers than the archive now holds
        records = archive_records(board, part)
        if records is not None:
            written.append(records)
    return written


def restore_answers(board: Path, part: Path) -> bool:
    """Seed a part that has nothing yet from the board's archived answers (see
    archive_answers), and a kvpress part's records with them where they are archived: written
    after its answers, so a render takes them as up to date. Returns whether it did."""
    source, target = archived(board, part), resume_file(part)
    if target.exists() or not source.exists():
        return False
    part.mkdir(parents=True, exist_ok=True)
    target.write_bytes(gzip.decompress(source.read_bytes()))
    records = archived_records(board, part)
    if records is not None and records.exists():
        (part / "records.jsonl").write_bytes(gzip.decompress(records.read_bytes()))
    return True


def restore_missing_parts(board: Path, work: Path) -> list[Path]:
    """Restore each part archived beside the board that has no answers under `work` (see
    restore_answers), saying so: a sweep resumes from them, and a render pairs their samples
    with the others' (published rows keep no per-sample scores). Returns the parts restored."""
    restored = []
    for source in sorted((board / "answers").glob("*-*of*.*.jsonl.gz")):
        part = work / source.name.split(".")[0]
        if restore_answers(board, part):
            print(f"{part.name}: restored from {source}", file=sys.stderr)
            restored.append(part)
    return restored
