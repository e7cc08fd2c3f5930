"""The files of `minidecode batch`: a JSONL requests file read into its lines (each line refused
on its own when it is not a JSON object), and the results written a JSON line each as requests
end, with the run's progress line on stderr. A result's JSON fields are those `generate --json`
prints too."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from minidecode.errors import UserError


def result_fields(result) -> dict:
    """A GenerationResult as `--json` writes it: text, finish reason, new token ids, stats (and the
    log-probabilities, and each token's top alternatives as [id, log p] pairs, when they were
    asked for)."""
    fields = {
        "text": result.text,
        "finish_reason": result.finish_reason,
        "token_ids": result.token_ids,
        "stats": asdict(result.stats),
    }
    if result.logprobs is not None:
        fields["logprobs"] = result.logprobs
    if getattr(result, "top_logprobs", None) is not None:
        fields["top_logprobs"] = [[list(pair) for pair in top] for top in result.top_logprobs]
    return fields


@dataclass
class BatchLine:
    """One non-blank line of a requests file: its request fields, or why it was refused as read."""

    line: int  # 1-based line number in the file
    id: object  # the request's "id" (any JSON scalar), else the line number
    fields: dict | None = None  # the request without its id (PromptRequest's fields)
    error: str | None = None


def read_requests(source: str) -> list[BatchLine]:
    """The requests of a JSONL file (or of stdin for `-`): one JSON object a line, blank lines
    skipped. A line that is not valid UTF-8, not JSON or not an object is refused on its own; a file
    that cannot be read, or holds no request, is a UserError."""
    if source == "-":
        if sys.stdin is None or sys.stdin.isatty():
            raise UserError("no requests on stdin: pipe a JSONL file, or give its path instead of -")
        data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
        data, name = data.encode("utf-8") if isinstance(data, str) else data, "stdin"
    else:
        path, name = Path(source), f"requests file {source}"
        if path.is_dir():
            raise UserError(f"{name} is a directory; give a JSONL file")
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise UserError(f"{name} does not exist") from None
        except OSError as e:
            raise UserError(f"could not read {name}: {e}") from None
    # bytes.splitlines: only \n, \r and \r\n end a line (a JSON string may hold U+2028 as is)
    lines = [parse_request_line(n, raw) for n, raw in enumerate(data.splitlines(), 1) if raw.strip()]
    if not lines:
        raise UserError(f"{name} holds no requests (one JSON object a line)")
    return lines


def parse_request_line(number: int, raw: bytes) -> BatchLine:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return BatchLine(
            number, number, error=f"not valid UTF-8: byte 0x{raw[e.start]:02x} at offset {e.start}"
        )
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as e:
        return BatchLine(number, number, error=f"not valid JSON: {e.msg} at column {e.colno}")
    if not isinstance(fields, dict):
        return BatchLine(
            number, number, error=f"not a JSON object but {type(fields).__name__} {text.strip()[:40]}"
        )
    request_id = fields.pop("id", number)
    if isinstance(request_id, dict | list):
        return BatchLine(number, number, error="id must be a JSON scalar (string, number, boolean or null)")
    return BatchLine(number, request_id, fields)


class BatchReport:
    """A batch's results, one JSON line each, written and flushed as each request ends (to
    --output or stdout), and its progress line on stderr: redrawn in place on a terminal; in a log,
    a plain line at every tenth of the requests ended."""

    def __init__(self, output: Path | None, entries: list[BatchLine], progress: bool):
        from minidecode.llm import BatchProgress

        self.output, self.entries, self.enabled = output, entries, progress
        self.refused = sum(entry.error is not None for entry in entries)  # refused as read
        self.progress = BatchProgress()  # the run's, once it starts
        self.tty = sys.stderr.isatty()
        self.drawn, self.logged = 0.0, -1  # when the terminal line was last drawn; the last tenth logged

    def __enter__(self) -> BatchReport:
        self.out = sys.stdout if self.output is None else open(self.output, "w", encoding="utf-8")  # noqa: SIM115
        for entry in self.entries:
            if entry.error is not None:
                self.write(entry)
        return self

    def __exit__(self, *exc) -> None:
        if self.output is not None:
            self.out.close()

    def write(self, entry: BatchLine, result=None) -> None:
        """`entry`'s result line: its answer, or its error (refused as read, or by the model)."""
        error = entry.error if result is None else result.error
        record = {"id": entry.id, "line": entry.line}
        if error is not None:
            record["error"] = error
        else:
            fields = result_fields(result)
            record.update(text=fields.pop("text"), finish_reason=fields.pop("finish_reason"))
            record.update(token_ids=fields.pop("token_ids"), prompt_tokens=len(result.prompt_token_ids))
            record.update(fields)
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()
        self.draw()

    def counts(self):
        """The run's progress with the lines refused as read counted in."""
        import dataclasses

        p = self.progress
        return dataclasses.replace(p, total=p.total + self.refused, failed=p.failed + self.refused)

    def draw(self, final: bool = False) -> None:
        if not self.enabled:
            return
        p = self.counts()
        ended = p.done + p.failed
        line = (
            f"batch {ended:,}/{p.total:,} requests ({p.failed:,} failed), {p.running} running, "
            f"{p.waiting:,} waiting, {p.tokens_per_s:,.1f} tok/s"
        )
        if not self.tty:
            tenth = 10 * ended // p.total
            if tenth > self.logged:
                self.logged = tenth
                sys.stderr.write(line + "\n")
                sys.stderr.flush()
            return
        now = time.perf_counter()
        if final or now - self.drawn >= 0.1:
            self.drawn = now
            sys.stderr.write(f"\r{line}\033[K" + ("\n" if final else ""))
            sys.stderr.flush()


def batch_stats_line(progress, seconds: float) -> str:
    """The summary of a finished batch run; where speculation ran, its drafts: how many were kept
    of those proposed, and the tokens a decode step made (1 + its kept drafts), on average."""
    rate = progress.new_tokens / max(seconds, 1e-9)
    line = (
        f"{progress.done:,} done, {progress.failed:,} failed of {progress.total:,} requests | "
        f"{progress.new_tokens:,} new tok in {seconds:.2f} s ({rate:,.1f} tok/s)"
    )
    if progress.proposed_tokens:
        steps = progress.decode_steps
        per_step = (steps + progress.accepted_tokens) / max(steps, 1)
        line += (
            f" | drafts {progress.accepted_tokens:,} of {progress.proposed_tokens:,} accepted, "
            f"{per_step:.2f} tok/step"
        )
    return line
