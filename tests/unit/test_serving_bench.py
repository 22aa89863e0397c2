"""The serving benchmark's pure parts: percentiles, the prompts, summaries, the config builder, the
HTTP/SSE parsers, the split of a cell over client processes, the load drivers, the client against a
local socket server, and the report's goals and tables."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from bench.common import percentile, pipeline_args, serve_doc, set_path, stats
from bench.http_client import (
    Connection,
    Record,
    arrivals,
    assign,
    drive,
    split_concurrency,
    stream_completion,
)
from bench.http_wire import ChunkedDecoder, ProtocolError, SSEParser, read_event, tokens_in_event
from bench.report import goals, markdown, render
from bench.serving_cells import cell_requests, label, prompts
from bench.serving_stats import raw_rows, summarize
from moriio_ray import parse_pipeline_config

ROOT = Path(__file__).resolve().parents[2]

# -- percentiles, schedule, summaries ---------------------------------------------------------------


def test_percentile_interpolates_between_order_statistics() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0.0) == 1.0
    assert percentile(values, 1.0) == 4.0
    assert percentile(values, 0.5) == pytest.approx(2.5)
    assert percentile(values, 0.99) == pytest.approx(3.97)
    assert percentile([7.0], 0.99) == 7.0
    assert percentile([], 0.5) is None
    with pytest.raises(ValueError, match="q"):
        percentile(values, 1.5)


def test_stats_p50_p99_mean() -> None:
    assert stats([1.0, 2.0, 3.0]) == {"p50": 2.0, "p99": pytest.approx(2.98), "mean": 2.0}
    assert stats([]) == {"p50": None, "p99": None, "mean": None}


def test_cell_requests_are_waves_of_concurrency_with_a_floor() -> None:
    a = argparse.Namespace(requests=16, waves=4)
    assert cell_requests(a, ("c", 1)) == 16
    assert cell_requests(a, ("c", 64)) == 256
    assert cell_requests(a, ("rate", 64.0)) == 16  # open loop: the fixed count
    assert (label(("c", 32)), label(("rate", 2.0)), label(("rate", 0.5))) == ("c=32", "rate=2", "rate=0.5")


def test_prompts_are_deterministic_exact_length_and_in_range() -> None:
    a = prompts(5, 128, seed=3)
    assert a == prompts(5, 128, seed=3)
    assert len(a) == 5 and all(len(p) == 128 for p in a)
    assert all(0 <= t < 256 for p in a for t in p)
    assert prompts(5, 128, seed=4) != a
    mixed = prompts(400, 32, seed=0, long_fraction=0.25, long_len=512)
    long = [p for p in mixed if len(p) >= 512]
    assert all(32 <= len(p) <= 64 or 512 <= len(p) <= 1024 for p in mixed)
    assert 0.15 < len(long) / len(mixed) < 0.35


def test_poisson_arrivals_are_seeded_and_increasing() -> None:
    at = arrivals(200, 10.0, seed=1)
    assert at == arrivals(200, 10.0, seed=1) and at == sorted(at)
    assert 10 < at[-1] < 30  # 200 requests at 10/s: about 20 s


def _rec(index: int, sent: float, first: float, last: float, tokens: int, error: str | None = None) -> Record:
    return Record(
        index=index,
        sent_s=sent,
        first_s=first,
        last_s=last,
        done_s=last,
        num_tokens=tokens,
        num_chunks=tokens,
        status=200,
        error=error,
    )


def test_summarize_ttft_tpot_throughput_and_short_requests() -> None:
    records = [
        _rec(0, 10.0, 10.1, 10.4, 4),  # TTFT 0.1, TPOT 0.1
        _rec(1, 10.0, 10.3, 10.9, 4),  # TTFT 0.3, TPOT 0.2
        _rec(2, 10.5, 10.6, 10.7, 2),  # too few tokens: an error
        Record(index=3, sent_s=10.2, status=500, error="boom"),
    ]
    s = summarize(records, expected_tokens=4)
    assert (s["num_requests"], s["num_ok"], s["num_errors"]) == (4, 2, 2)
    assert s["output_tokens"] == 8
    assert s["span_s"] == pytest.approx(0.9)
    assert s["output_tok_s"] == pytest.approx(8 / 0.9)
    assert s["ttft_s"]["p50"] == pytest.approx(0.2)
    assert s["tpot_s"]["mean"] == pytest.approx(0.15)
    assert s["tokens_per_chunk"] == 1.0
    assert any("expected 4" in e for e in s["errors"]) and any("boom" in e for e in s["errors"])
    rows = raw_rows(records)
    assert rows[0][:3] == [0, 0.0, pytest.approx(0.1)]
    assert rows[3][2] is None and rows[3][-1] == "boom"


# -- configs -------------------------------------------------------------------------------------


@pytest.mark.parametrize("gpu", [False, True])
def test_pipeline_args_derive_each_system(gpu: bool) -> None:
    base = {"model": {"preset": "tiny"}, "engine": {"block_size": 16, "gpu_memory_fraction": 0.6}}
    for system in ("colocated", "read", "write"):
        args = pipeline_args(
            base, system, gpu=gpu, max_concurrency=128, max_prompt_len=1024, output_tokens=64
        )
        cfg = parse_pipeline_config(args)
        assert cfg.engine.max_num_seqs == 128
        assert cfg.engine.num_blocks is not None and cfg.engine.num_blocks >= 128 * (1024 + 64) // 16
        assert cfg.engine.max_num_batched_tokens >= 1024
        assert cfg.serve.max_ongoing_requests >= 128
        assert cfg.transfer.backend == ("cuda_ipc" if gpu else "shm")
        if system == "colocated":
            assert cfg.mode == "colocated" and cfg.pool.colocated.num_gpus == (1.0 if gpu else 0.0)
        else:
            assert cfg.mode == system
            assert cfg.pool.prefill.num_gpus == cfg.pool.decode.num_gpus == (0.5 if gpu else 0.0)
    assert base == {"model": {"preset": "tiny"}, "engine": {"block_size": 16, "gpu_memory_fraction": 0.6}}
    with pytest.raises(ValueError, match="system"):
        pipeline_args(base, "engine", gpu=gpu, max_concurrency=1, max_prompt_len=8, output_tokens=2)


def test_pipeline_args_overrides_backend_and_colocated_replicas() -> None:
    base = serve_doc(ROOT / "configs" / "tiny_1p1d_cpu.yaml")["applications"][0]["args"]
    sets = ["engine.num_blocks=2048", "serve.stream_interval=1", "name=x", "pool.prefill.num_cpus=1"]
    cfg = parse_pipeline_config(pipeline_args(base, "write", backend="tcp", overrides=sets))
    assert (cfg.engine.num_blocks, cfg.serve.stream_interval, cfg.name) == (2048, 1, "x")
    assert (cfg.transfer.backend, cfg.mode, cfg.pool.prefill.num_cpus) == ("tcp", "write", 1.0)
    cfg = parse_pipeline_config(pipeline_args(base, "colocated", colocated_replicas=2))
    assert cfg.pool.colocated.replicas == 2 and cfg.pool.prefill.replicas == 0


def test_set_path_and_serve_doc(tmp_path: Path) -> None:
    args: dict[str, Any] = {"serve": {"num_replicas": 2}}
    set_path(args, "serve.stream_interval=4")
    set_path(args, "engine.enable_prefix_caching=false")
    assert args == {
        "serve": {"num_replicas": 2, "stream_interval": 4},
        "engine": {"enable_prefix_caching": False},
    }
    bare = tmp_path / "bare.yaml"
    bare.write_text("name: bare\nmodel: {preset: tiny}\n")
    assert serve_doc(bare)["applications"][0]["args"] == {"name": "bare", "model": {"preset": "tiny"}}
    assert (
        serve_doc(ROOT / "configs" / "tiny_1p1d_cpu.yaml")["applications"][0]["args"]["name"] == "tiny-1p1d"
    )


# -- HTTP and SSE --------------------------------------------------------------------------------


def _chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def test_chunked_decoder_any_split() -> None:
    body = [b"data: a\n\n", b"data: bb\n", b"\ndata: [DONE]\n\n"]
    raw = _chunked(*body)
    for cut in range(1, 12):
        dec = ChunkedDecoder()
        out = b"".join(dec.feed(raw[i : i + cut]) for i in range(0, len(raw), cut))
        assert out == b"".join(body) and dec.done
    dec = ChunkedDecoder()
    dec.feed(b"3;ext=1\r\nabc\r\n")
    assert not dec.done
    with pytest.raises(ProtocolError, match="chunk size"):
        ChunkedDecoder().feed(b"zz\r\n")
    with pytest.raises(ProtocolError, match="CRLF"):
        ChunkedDecoder().feed(b"1\r\naXY")


def test_sse_parser_events_across_feeds_crlf_comments_multiline() -> None:
    stream = b': hi\r\ndata: {"a": 1}\r\n\r\ndata:x\ndata: y\n\nevent: e\nid: 3\n\ndata: [DONE]\n\n'
    for cut in (1, 2, 5, len(stream)):
        sse = SSEParser()
        events = [e for i in range(0, len(stream), cut) for e in sse.feed(stream[i : i + cut])]
        assert events == [b'{"a": 1}', b"x\ny", b"[DONE]"]


def _event(num_tokens: int) -> bytes:
    lp = {"tokens": ["t"] * num_tokens, "token_logprobs": [0.0] * num_tokens, "text_offset": [0] * num_tokens}
    return json.dumps({"id": "x", "choices": [{"index": 0, "text": "t", "logprobs": lp}]}).encode()


def test_tokens_in_event() -> None:
    assert tokens_in_event(_event(3)) == 3
    assert tokens_in_event(b"[DONE]") == -1
    assert tokens_in_event(b'{"choices": [], "usage": {"prompt_tokens": 1}}') == 0
    assert read_event(b'{"choices": [], "usage": {"completion_tokens": 5}}') == (0, 5)
    assert read_event(_event(2)) == (2, None)
    assert tokens_in_event(b'{"choices": [{"text": "a", "logprobs": null}]}') == 0
    with pytest.raises(ProtocolError, match="overloaded"):
        tokens_in_event(b'{"error": {"message": "overloaded", "code": 503}}')
    with pytest.raises(ProtocolError, match="not a completion chunk"):
        tokens_in_event(b"{not json")


def test_split_concurrency_and_assign() -> None:
    assert split_concurrency(1, 4) == [1]
    assert split_concurrency(8, 4) == [2, 2, 2, 2]
    assert split_concurrency(10, 4) == [3, 3, 2, 2]
    groups = assign(20, [3, 3, 2, 2])
    assert sorted(i for g in groups for i in g) == list(range(20))
    assert [len(g) for g in groups] == [6, 6, 4, 4]
    assert all(g == sorted(g) for g in groups)


@pytest.mark.timeout(20)
def test_drive_keeps_concurrency_closed_loop_and_arrivals_open_loop() -> None:
    async def main() -> tuple[list[Record], int, list[Record], list[float]]:
        running = peak = 0
        t0 = asyncio.get_running_loop().time()
        started: list[float] = []

        async def one(slot: int, item: int) -> Record:
            nonlocal running, peak
            running += 1
            peak = max(peak, running)
            started.append(asyncio.get_running_loop().time() - t0)
            await asyncio.sleep(0.001)
            running -= 1
            return Record(index=item, status=200)

        def timed_out(slot: int, item: int) -> Record:
            return Record(index=item, error="timeout")

        records = await drive(list(range(30)), one, timed_out, timeout_s=5.0, concurrency=4)
        peak_closed, started[:] = peak, []
        t0 = asyncio.get_running_loop().time()
        opened = await drive([0, 1, 2], one, timed_out, timeout_s=5.0, at_s=[0.0, 0.05, 0.1])
        return records, peak_closed, opened, list(started)

    records, peak, opened, started = asyncio.run(main())
    assert sorted(r.index for r in records) == list(range(30)) and peak == 4
    assert [r.index for r in opened] == [0, 1, 2]
    assert started[1] >= 0.045 and started[2] >= 0.095  # each at its arrival time


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("usage", "error"), [(None, None), (4, None), (3, "usage says 3"), (-1, "usage says None")]
)
def test_stream_completion_against_a_local_chunked_sse_server(usage: int | None, error: str | None) -> None:
    """Two requests on one keep-alive connection; the server splits events across chunks and reads.

    ``usage``: the usage event's completion_tokens (-1: none sent although asked for; None: not asked)."""
    requests: list[bytes] = []
    usage_event = (
        b""
        if usage in (None, -1)
        else b'data: {"choices": [], "usage": {"completion_tokens": %d}}\n\n' % usage
    )

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(
                next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1]
            )
            requests.append(await reader.readexactly(length))
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            )
            frames = b"".join(b"data: " + _event(n) + b"\n\n" for n in (1, 2, 1)) + usage_event
            frames += b"data: [DONE]\n\n"
            for i in range(0, len(frames), 37):  # chunks that cut events anywhere
                writer.write(b"%x\r\n%s\r\n" % (len(frames[i : i + 37]), frames[i : i + 37]))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        writer.close()

    async def main() -> list[Record]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        conn = Connection("127.0.0.1", port)
        await conn.open()
        try:
            return [
                await stream_completion(
                    conn, "/v1/completions", i, b'{"i": %d}' % i, check_usage=usage is not None
                )
                for i in range(2)
            ]
        finally:
            conn.close()
            server.close()
            await server.wait_closed()

    records = asyncio.run(main())
    assert requests == [b'{"i": 0}', b'{"i": 1}']
    for i, rec in enumerate(records):
        assert rec.index == i and rec.status == 200
        assert rec.error is None if error is None else error in (rec.error or "")
        assert rec.num_tokens == 4 and rec.num_chunks == 3
        assert rec.sent_s <= rec.first_s <= rec.last_s <= rec.done_s


@pytest.mark.timeout(20)
def test_stream_completion_records_an_http_error() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        body = b'{"error": {"message": "too many"}}'
        writer.write(b"HTTP/1.1 429 Too Many\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    async def main() -> Record:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        conn = Connection("127.0.0.1", server.sockets[0].getsockname()[1])
        try:
            return await stream_completion(conn, "/v1/completions", 0, b"{}")
        finally:
            conn.close()
            server.close()
            await server.wait_closed()

    rec = asyncio.run(main())
    assert rec.status == 429 and rec.error is not None and "too many" in rec.error and not rec.ok


# -- the report ----------------------------------------------------------------------------------


def _cell(series: str, c: int, length: int, tok_s: float, tpot_s: float, ttft_s: float) -> dict[str, Any]:
    summary = {
        "num_ok": 4,
        "num_requests": 4,
        "num_errors": 0,
        "output_tok_s": tok_s,
        "tpot_s": {"p50": tpot_s, "p99": 2 * tpot_s},
        "ttft_s": {"p50": ttft_s, "p99": 2 * ttft_s},
    }
    return {"series": series, "load": f"c={c}", "concurrency": c, "prompt_len": length, "summary": summary}


def test_goals_and_tables_from_a_report() -> None:
    cells = []
    for c in (1, 64):
        for length in (128, 1024):
            cells.append(_cell("engine", c, length, 1000.0 * c, 0.002, 0.010))
            cells.append(_cell("colocated/python", c, length, 900.0 * c, 0.0023, 0.011))
            cells.append(_cell("pd-read/python", c, length, 500.0 * c, 0.004, 0.030))
    cells.append({"series": "pd-read/http", "load": "c=1", "prompt_len": 128, "error": "launch failed"})
    report = {
        "grid": {"concurrency": [1, 64], "prompt_lens": [128, 1024], "output_tokens": 64},
        "engine_decode_only": {"batch": 64, "decode_tok_s": 70000.0},
        "cells": cells,
    }
    by = {row["measure"]: row for row in goals(report)}
    rate = "output_tok_s / decode_only, c=64 prompt 128"
    assert by[f"colocated/python {rate}"]["value"] == pytest.approx(900 * 64 / 70000)
    assert by[f"colocated/python {rate}"]["met"] is False  # 0.82 < 0.85
    assert by["colocated/python tpot_s.p50 - engine, c=1 prompt 128"]["met"] is True  # TPOT + 0.3 ms
    assert by["pd-read/python tpot_s.p50 - engine, c=1 prompt 128"]["met"] is False  # TPOT + 2 ms
    assert by["colocated/python ttft_s.p50 - engine, c=1 prompt 1024"]["met"] is True  # TTFT + 1 ms
    assert by["pd-read/python ttft_s.p50 - engine, c=1 prompt 1024"]["met"] is None  # + the raw transfer
    assert by[f"pd-read/http {rate}"]["value"] is None  # a failed series decides nothing
    assert by["cells that did not run"]["met"] is False
    assert by["pd-read/python tpot_s.p50 / colocated/python, c=64 prompt 128"]["value"] == pytest.approx(
        0.004 / 0.0023
    )
    table = markdown(report)
    assert "| colocated/python | 128 | 900 (0.90) | 57,600 (0.90) |" in table
    assert "| pd-read/http | 128 | - | - |" in table
    assert "| engine | 1024 | 2.0 / 4.0 | 2.0 / 4.0 | 10.0 / 20.0 | 10.0 / 20.0 |" in table


def test_http_goals_compare_each_serve_mode_with_the_python_api() -> None:
    cells = []
    for c in (1, 64, 128):
        cells.append(_cell("colocated/python", c, 128, 100.0 * c, 0.002, 0.010))
        cells.append(_cell("colocated/http", c, 128, 50.0 * c, 0.004, 0.030))  # half the rate, slow TTFT
        cells.append(_cell("colocated/http-fast", c, 128, 95.0 * c, 0.002, 0.0115))
    cells[-1]["summary"]["num_errors"] = 1  # one request of the last cell failed
    report = {
        "grid": {"concurrency": [1, 64, 128], "prompt_lens": [128], "output_tokens": 64},
        "engine_decode_only": {"batch": 64, "decode_tok_s": 8000.0},
        "cells": cells,
    }
    by = {row["measure"]: row for row in goals(report) if row["issue"] == 20}
    slow, fast = (
        "colocated/http output_tok_s / colocated/python",
        "colocated/http-fast output_tok_s / colocated/python",
    )
    assert by[f"{slow}, c=128 prompt 128"]["value"] == pytest.approx(0.5)
    assert by[f"{slow}, c=64 prompt 128"]["met"] is False
    assert by[f"{fast}, c=64 prompt 128"]["met"] is True  # 0.95
    decode = "colocated/http-fast output_tok_s / decode_only, c=64 prompt 128"
    assert by[decode]["value"] == pytest.approx(95 * 64 / 8000)
    assert by["colocated/http ttft_s.p50 - colocated/python, c=1 prompt 128"]["met"] is False  # + 20 ms
    assert by["colocated/http-fast ttft_s.p50 - colocated/python, c=1 prompt 128"]["met"] is True  # + 1.5 ms
    assert by["colocated/http ttft_s.p50 / colocated/python, c=64 prompt 128"]["value"] == pytest.approx(3.0)
    assert by["colocated/http-fast ttft_s.p50 / colocated/python, c=64 prompt 128"]["met"] is True
    errors = by["requests that failed, or whose usage differed from the tokens received"]
    assert errors["value"] == 1 and errors["met"] is False


def test_render_writes_tables_and_a_plot(tmp_path: Path) -> None:
    cells = [
        _cell(name, c, 128, 100.0 * c, 0.002, 0.010) for name in ("engine", "pd-read/python") for c in (1, 4)
    ]
    cells[-1]["summary"]["timings"] = {
        "handoff_s": {"p50": 0.003, "p99": 0.005},
        "handoff_rpc_s": {"p50": 0.002},
        "handoff_local_s": {"p50": 0.001},
        "transfer_s": {"p50": 0.0005},
    }
    report = {
        "workload": "random",
        "grid": {"concurrency": [1, 4], "prompt_lens": [128], "output_tokens": 64},
        "cells": cells,
        "host": {"cpu": "test cpu"},
        "args": {"config": "configs/tiny_1p1d_cpu.yaml"},
        "commit": "abc",
    }
    render(report, tmp_path / "serving_t")
    text = (tmp_path / "serving_t.md").read_text()
    assert "| pd-read/python | 128 | 100 (1.00) | 400 (1.00) |" in text
    assert "| pd-read/python | c=4 | 128 | 3.0 / 5.0 | 2.0 | 1.0 | 0.5 | 10.0 / 20.0 |" in text
    assert "Goals" in text and (tmp_path / "serving_t.png").stat().st_size > 10_000
    assert json.loads(json.dumps(report)) == report  # the report is plain JSON


@pytest.mark.timeout(30)
def test_run_series_writes_the_record_after_every_cell(tmp_path: Path) -> None:
    """A run killed mid-way (a time limit, a signal that skips the clean-up) keeps every cell it ran:
    the record is rewritten after each one."""
    from bench.serving_cells import run_series

    checkpoint = tmp_path / "serving_x.json"
    seen: list[int] = []

    async def cell(batch: Any, load: Any) -> Any:
        on_disk = json.loads(checkpoint.read_text())["cells"] if checkpoint.exists() else []
        seen.append(len(on_disk))  # the cells written before this one ran
        raise RuntimeError(f"cell {len(seen)} fails")

    a = argparse.Namespace(
        concurrency=[1, 2],
        rates=[],
        prompt_lens=[8],
        warmup=0,
        profile=False,
        out=tmp_path,
        requests=1,
        waves=1,
        seed=0,
        long_fraction=0.0,
        long_len=0,
        checkpoint=checkpoint,
    )
    report: dict[str, Any] = {"cells": [], "profiles": {}}
    asyncio.run(run_series(a, report, "s", cell))
    assert seen == [0, 1]
    cells = json.loads(checkpoint.read_text())["cells"]
    assert [c["load"] for c in cells] == ["c=1", "c=2"] and all("cell" in c["error"] for c in cells)
