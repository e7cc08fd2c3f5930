"""What a `minidecode bench` run writes: its header (model, device, date, commit, torch), the
markdown tables, the JSON object, and the OUT.json / OUT.md / OUT.png files, each with the exact
command and the roofline formula; for `--batch`, the batch table's files."""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path
from typing import Any


def run_metadata(llm: Any, command: str) -> dict:
    """The run's model, device, dtypes, date, minidecode's own commit and version, torch, command."""
    import torch

    from minidecode.benchmarks.e2e import provenance
    from minidecode.cache import kv_dtype_name

    about = provenance()  # minidecode's own commit, whatever the current folder
    return {
        "model": llm.name,
        "device": torch.cuda.get_device_name(llm.device) if llm.device.type == "cuda" else "CPU",
        "dtype": str(llm.dtype).removeprefix("torch."),
        "kv_cache_dtype": kv_dtype_name(llm.engine.kv_dtype),
        "prefill_backend": getattr(llm.engine, "prefill_backend", None),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": about["commit"] or "none",
        "minidecode_version": about["version"],
        "torch": torch.__version__,
        "command": command,
    }


@dataclasses.dataclass
class Report:
    """A bench run's text: the header line, the markdown tables, and the JSON object's text; and
    the run's metadata (run_metadata)."""

    header: str
    tables: str
    json_text: str
    about: dict


def e2e_report(llm: Any, settings: Any, results: list, ceilings: Any, command: str) -> Report:
    """The end-to-end bench's report (e2e.py's results and read ceilings)."""
    from minidecode.benchmarks.e2e import FORMULA, finite_or_none, format_tables

    about = run_metadata(llm, command)
    header = (
        f"{llm.name} on {about['device']}, {about['dtype']}, KV cache {about['kv_cache_dtype']}, batch 1; "
        f"{about['date']}, commit {about['commit']}; torch {about['torch']}"
    )
    data = {
        **about,
        "formula": FORMULA,
        "settings": dataclasses.asdict(settings),
        "read_ceiling_bytes_per_s": ceilings.read_bytes_per_s,
        "copy_ceiling_bytes_per_s": ceilings.copy_bytes_per_s,
        "ceiling_buffer_bytes": ceilings.buffer_bytes,
        "results": [dataclasses.asdict(r) for r in results],
    }
    text = json.dumps(finite_or_none(data), indent=2, allow_nan=False)
    return Report(header, format_tables(results, ceilings), text, about)


def write_e2e(report: Report, llm: Any, results: list, command: str, outputs: list[Path], plot: bool) -> None:
    """OUT.json, OUT.md and (plot) OUT.png: `outputs` in that order."""
    from minidecode.benchmarks.e2e import FORMULA
    from minidecode.benchmarks.e2e import plot as plot_results

    json_path, markdown_path, plot_path = outputs
    json_path.write_text(report.json_text + "\n")
    markdown_path.write_text(
        f"# End-to-end benchmark\n\n{report.header}\n\ncommand: `{command}`\n\nroofline: {FORMULA}\n\n"
        f"{report.tables}\n"
    )
    if plot:
        about = report.about
        plot_results(
            results, str(plot_path), f"{llm.name} on {about['device']} ({about['date']}, {about['commit']})"
        )


def write_batch(
    llm: Any, results: list, ceilings: Any, window: int, table: str, command: str, outputs: list[Path]
) -> None:
    """`bench --batch`'s OUT.json and OUT.md (`outputs` in that order)."""
    meta = run_metadata(llm, command)
    payload = {
        "metadata": meta,
        "window": window,
        "ceiling_read_gb_per_s": ceilings.read_bytes_per_s / 1e9,
        "results": [dataclasses.asdict(r) for r in results],
    }
    outputs[0].write_text(json.dumps(payload, indent=1) + "\n")
    header = (
        f"# Batched decode\n\n{meta['device']} · {meta['date']} · commit {meta['commit']} · {meta['model']}"
    )
    header += f" ({meta['dtype']}, KV cache {meta['kv_cache_dtype']}) · command: `{command}`\n\n"
    outputs[1].write_text(header + table + "\n")
