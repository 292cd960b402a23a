"""`pe-client`: stream a generation to the terminal, or compare scalings side by side.

pe-client generate --pe rope --scaling yarn --factor 4 "def fib(n):"
pe-client generate --pe rope --attention self_extend:group_size=4,window=64 "def fib(n):"
pe-client compare --pe rope --scalings none,linear,ntk,yarn --factor 4 "def fib(n):"
pe-client models
pe-client --grpc 127.0.0.1:50051 models      # any command but the lab's over gRPC (pe-client[grpc])
pe-client sweep --corpus pydoc-topics --lengths 256,1024,4096 --scaling none --scaling 'yarn:factor=4|16'
pe-client sweep --text-file t.txt --lengths 512,1024 --model zoo-rope@ntk:factor=4 --attention rerope:window=8
pe-client passkey --lengths 512,2048 --depths 0.1,0.5,0.9 --scaling none --scaling dynamic:factor=4 --trials 5
pe-client ruler --tasks niah_single,vt,cwe --lengths 1024,4096 --samples 20 --scaling 'yarn:factor=4' --json
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, get_args

import httpx
from pydantic import ValidationError

from pe_client._version import __version__
from pe_client.async_client import AsyncPEClient
from pe_client.attention import PEAttention
from pe_client.client import PEClient
from pe_client.corpora import CORPORA, corpus_text
from pe_client.errors import PEServeError
from pe_client.grid import GridError, check_grid, configurations, label, parse_attention_specs
from pe_client.lab_output import (
    ProgressBar,
    check_plot_path,
    passkey_table,
    plot_passkey,
    plot_ruler,
    plot_sweep,
    ruler_table,
    sweep_table,
)
from pe_client.passkey import PasskeyResult, async_passkey
from pe_client.ruler import RulerResult, async_ruler
from pe_client.ruler_tasks import TASKS, check_tasks
from pe_client.scaling import PEScaling, ScalingType, parse_scaling
from pe_client.sweep import PASSES_IN_FLIGHT, SweepResult, async_sweep
from pe_client.types import (
    GenerateRequest,
    GenerateResponse,
    Scheme,
    ScoreRequest,
    ScoreResponse,
    StreamToken,
)

if TYPE_CHECKING:
    from pe_client.grpc import AsyncGrpcPEClient, GrpcPEClient

COLUMN_GAP = " | "
# `compare` sends all its requests at once; a server with a small queue turns some away with 429
# and a Retry-After, and the CLI is meant to wait those out rather than give up after the SDK's two.
CLI_MAX_RETRIES = 10
# Scoring 16k tokens under a dozen scalings at once can take many minutes before the first answer.
LAB_TIMEOUT = httpx.Timeout(None, connect=5.0)
# The exit status of a run stopped by Ctrl-C, as shells report SIGINT.
INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return int(args.run(args))
    except (PEServeError, ValidationError) as exc:
        print(f"pe-client: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pe-client: interrupted; the requests in flight were cancelled", file=sys.stderr)
        return INTERRUPTED


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pe-client", description="Client for pe-serve.")
    parser.add_argument("--version", action="version", version=f"pe-client {__version__}")
    parser.add_argument("--url", help="server URL (default: $PE_SERVE_URL or http://127.0.0.1:8000)")
    parser.add_argument("--api-key", help="API key (default: $PE_SERVE_API_KEY)")
    parser.add_argument(
        "--grpc",
        metavar="HOST:PORT",
        default=None,
        help="talk gRPC to this target instead of HTTP (pe-client[grpc])",
    )
    parser.add_argument(
        "--max-retries",
        type=int,
        default=CLI_MAX_RETRIES,
        metavar="N",
        help=f"retries of a request refused as busy (429, 503) or cut off (default {CLI_MAX_RETRIES})",
    )
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    generate = commands.add_parser("generate", help="stream one generation to the terminal")
    _add_generation_options(generate)
    generate.add_argument(
        "--scaling",
        choices=get_args(ScalingType),
        default=None,
        help="scaling type (default: the model's own)",
    )
    generate.set_defaults(run=_run_generate)

    compare = commands.add_parser("compare", help="the same prompt under several scalings, side by side")
    _add_generation_options(compare)
    compare.add_argument(
        "--scalings",
        default="none,linear,ntk,yarn",
        help="comma-separated scaling types (default: none,linear,ntk,yarn)",
    )
    compare.add_argument("--width", type=int, default=None, help="total output width (default: terminal)")
    compare.set_defaults(run=_run_compare)

    models = commands.add_parser("models", help="list the resident models")
    models.set_defaults(run=_run_models)

    sweep = commands.add_parser("sweep", help="bits per token of a text by length, under a grid of scalings")
    _add_lab_options(
        sweep,
        concurrency_default=f"{PASSES_IN_FLIGHT} passes: one per configuration, per length for dynamic",
    )
    _add_attention_option(sweep)
    text = sweep.add_mutually_exclusive_group(required=True)
    text.add_argument("--text-file", type=Path, metavar="FILE", help="the text to score; - reads stdin")
    text.add_argument("--corpus", choices=sorted(CORPORA), help="a text the client knows by name")
    sweep.set_defaults(run=_run_sweep)

    passkey = commands.add_parser("passkey", help="find a key hidden in filler: accuracy by depth and length")
    _add_lab_options(
        passkey,
        concurrency_default="all at once; the prompts of one configuration and trial go in turn",
        in_flight="configuration-and-trial chains",
    )
    _add_attention_option(passkey)
    passkey.add_argument("--depths", type=_floats, default=[0.1, 0.5, 0.9], help="default 0.1,0.5,0.9")
    passkey.add_argument(
        "--trials", type=int, default=1, help="keys per (length, depth), each with its own filler (default 1)"
    )
    passkey.add_argument("--seed", type=int, default=0, help="draws the keys and fillers (default 0)")
    passkey.set_defaults(run=_run_passkey)

    ruler = commands.add_parser(
        "ruler", help="RULER's synthetic tasks (retrieval, tracing, aggregation): scores by length"
    )
    _add_lab_options(
        ruler,
        scaling_required=False,
        concurrency_default="all at once; a needle or variable task's samples of one length "
        "go in turn under each configuration",
        in_flight="chains and lone samples",
    )
    _add_attention_option(ruler)
    ruler.add_argument(
        "--tasks",
        type=_names,
        default=list(TASKS),
        help=f"comma-separated (default: all of {','.join(TASKS)})",
    )
    ruler.add_argument("--samples", type=int, default=10, metavar="N", help="samples per cell (default 10)")
    ruler.add_argument("--seed", type=int, default=0, help="draws the samples (default 0)")
    ruler.add_argument(
        "--haystack",
        default="noise",
        metavar="noise|FILE",
        help="filler of the needle and variable tasks: RULER's noise (default) or a text file",
    )
    ruler.add_argument(
        "--dump", type=Path, metavar="FILE.jsonl", help="write every answered sample, one per line"
    )
    ruler.set_defaults(run=_run_ruler)
    return parser


def _add_lab_options(
    parser: argparse.ArgumentParser,
    *,
    scaling_required: bool = True,
    concurrency_default: str = "all at once",
    in_flight: str = "requests",
) -> None:
    """The options every lab command takes; without `--scaling`, `ruler` runs unscaled, and the
    others need the model's name to set the scaling (`NAME@SPEC`, an alias)."""
    parser.add_argument(
        "--model",
        default=None,
        help="a resident model, an --alias name, or either with @SPEC parts (e.g. zoo-rope@yarn:factor=4), "
        "which then stand for --scaling/--attention (default: the server's default model)",
    )
    parser.add_argument("--lengths", type=_ints, required=True, help="comma-separated token counts")
    parser.add_argument(
        "--scaling",
        dest="scalings",
        action="append",
        metavar="SPEC",
        help="none or TYPE:key=value,... (factor=2|4|8 expands); repeatable"
        + (" (required unless --model sets the scaling)" if scaling_required else " (default none)"),
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    parser.add_argument(
        "--plot", type=Path, metavar="FILE", help="write a plot (.png or .svg; pe-client[plot])"
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=None,
        metavar="N",
        help=f"{in_flight} in flight (default: {concurrency_default})",
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )


def _add_attention_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--attention",
        dest="attentions",
        action="append",
        default=None,
        metavar="SPEC",
        help="attention rule TYPE:key=value,... (window=256|512 expands), crossed with --scaling; "
        "repeatable (default: none sent)",
    )


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def _floats(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part.strip()]


def _client(args: argparse.Namespace) -> PEClient | GrpcPEClient:
    """The HTTP client, or with `--grpc` the gRPC one (imported only then: it needs the extra)."""
    if args.grpc is None:
        return PEClient(args.url, api_key=args.api_key, max_retries=args.max_retries)
    from pe_client.grpc import GrpcPEClient

    return GrpcPEClient(args.grpc, api_key=args.api_key, max_retries=args.max_retries)


def _async_client(args: argparse.Namespace) -> AsyncPEClient | AsyncGrpcPEClient:
    if args.grpc is None:
        return AsyncPEClient(args.url, api_key=args.api_key, max_retries=args.max_retries)
    from pe_client.grpc import AsyncGrpcPEClient

    return AsyncGrpcPEClient(args.grpc, api_key=args.api_key, max_retries=args.max_retries)


def _lab_client(args: argparse.Namespace) -> AsyncPEClient:
    """The lab's requests are long and many at once: HTTP, no read timeout."""
    if args.grpc is not None:
        raise PEServeError("the lab's commands (sweep, passkey, ruler) talk HTTP; leave out --grpc")
    return AsyncPEClient(args.url, api_key=args.api_key, max_retries=args.max_retries, timeout=LAB_TIMEOUT)


def _add_generation_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--model", default=None)
    parser.add_argument("--pe", choices=get_args(Scheme), default=None, help="positional scheme")
    parser.add_argument("--factor", type=float, default=None, help="scaling factor")
    parser.add_argument("--original-max-position-embeddings", type=int, default=None, metavar="N")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--min-p", type=float, default=None)
    parser.add_argument("--repetition-penalty", type=float, default=None, help="1 is off")
    parser.add_argument("--presence-penalty", type=float, default=None)
    parser.add_argument("--frequency-penalty", type=float, default=None)
    parser.add_argument("--min-tokens", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true", default=None)
    parser.add_argument("--stop-token-id", type=int, action="append", default=None, dest="stop_token_ids")
    parser.add_argument(
        "--attention",
        default=None,
        metavar="SPEC",
        help="attention rule (pe_attention) as TYPE:key=value,..., e.g. self_extend:group_size=4,window=512 "
        "or standard:logn=256 (default: none sent, standard attention)",
    )


def _attention(spec: str | None) -> PEAttention | None:
    """The one rule an `--attention SPEC` names (the lab's syntax, checked by the SDK's models
    before any request); None when the option is absent."""
    if spec is None:
        return None
    rules = parse_attention_specs([spec])
    if len(rules) != 1:
        raise GridError(f"--attention {spec!r}: one rule per request (key=a|b alternatives are for the lab)")
    return rules[0]


def _scaling(scaling_type: str, args: argparse.Namespace) -> PEScaling:
    """The typed scaling for a type named on the command line; `none` takes no parameters."""
    fields: dict[str, object] = {"type": scaling_type}
    if scaling_type != "none":
        fields["factor"] = args.factor
        fields["original_max_position_embeddings"] = args.original_max_position_embeddings
    return parse_scaling({name: value for name, value in fields.items() if value is not None})


def _generate_request(
    args: argparse.Namespace, scaling: PEScaling | None, attention: PEAttention | None
) -> GenerateRequest:
    return GenerateRequest(
        prompt=args.prompt,
        model=args.model,
        pe=args.pe,
        pe_scaling=scaling,
        pe_attention=attention,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        min_tokens=args.min_tokens,
        ignore_eos=args.ignore_eos,
        stop_token_ids=args.stop_token_ids,
    )


def _run_generate(args: argparse.Namespace) -> int:
    scaling = _scaling(args.scaling, args) if args.scaling else None
    request = _generate_request(args, scaling, _attention(args.attention))
    with (
        _client(args) as client,
        client.generate_stream(request) as stream,
    ):
        for event in stream:
            if isinstance(event, StreamToken):
                sys.stdout.write(event.text)
                sys.stdout.flush()
    final = stream.final
    if final is not None:
        print(
            f"\n[{final.finish_reason}: {final.usage.completion_tokens} tokens,"
            f" prompt {final.usage.prompt_tokens}]",
            file=sys.stderr,
        )
    return 0


@dataclass(frozen=True)
class _Column:
    """One scaling's outcome in `compare`: its generation and the prompt's perplexity under it."""

    label: str
    generation: GenerateResponse
    prompt_score: ScoreResponse


async def _compare(
    args: argparse.Namespace, scalings: list[PEScaling], attention: PEAttention | None
) -> list[_Column]:
    """All scalings at once: the server batches them, which is the point of per-request scaling.
    An attention rule, when given, applies to every column."""
    async with _async_client(args) as client:

        async def run(scaling: PEScaling) -> _Column:
            request = _generate_request(args, scaling, attention)
            score_request = ScoreRequest(
                prompt=args.prompt, model=args.model, pe=args.pe, pe_scaling=scaling, pe_attention=attention
            )
            generation, score = await asyncio.gather(client.generate(request), client.score(score_request))
            column_label = _label(scaling) if attention is None else f"{_label(scaling)} + {label(attention)}"
            return _Column(column_label, generation, score)

        return list(await asyncio.gather(*(run(scaling) for scaling in scalings)))


def _label(scaling: PEScaling) -> str:
    factor = getattr(scaling, "factor", None)
    return scaling.type if factor is None else f"{scaling.type} x{factor:g}"


def _run_compare(args: argparse.Namespace) -> int:
    scalings = [_scaling(name.strip(), args) for name in args.scalings.split(",") if name.strip()]
    columns = asyncio.run(_compare(args, scalings, _attention(args.attention)))
    width = args.width or shutil.get_terminal_size().columns
    print(_render_columns(columns, width))
    return 0


def _render_columns(columns: Sequence[_Column], total_width: int) -> str:
    """Side-by-side text: a header per scaling, the wrapped generations, then aligned summaries."""
    column_width = max(12, (total_width - len(COLUMN_GAP) * (len(columns) - 1)) // len(columns))
    texts = [_wrap(column.generation.text, column_width) for column in columns]
    text_height = max(len(lines) for lines in texts)
    cells = [
        [
            column.label,
            f"ctx {column.generation.pe.native_context}->{column.generation.pe.max_context}",
            "-" * column_width,
            *lines,
            *[""] * (text_height - len(lines)),
            "-" * column_width,
            f"finish: {column.generation.finish_reason}",
            f"attn factor: {column.generation.pe.attention_factor:.4f}",
            f"prompt ppl: {column.prompt_score.perplexity:.3f}",
        ]
        for column, lines in zip(columns, texts, strict=True)
    ]
    rows = zip(*cells, strict=True)
    return "\n".join(COLUMN_GAP.join(cell.ljust(column_width) for cell in row).rstrip() for row in rows)


def _wrap(text: str, width: int) -> list[str]:
    """Wrap generated text to a column; control bytes a small model emits are shown as `·`."""
    lines: list[str] = []
    for line in text.split("\n"):
        printable = "".join(char if char.isprintable() else "·" for char in line.replace("\t", " "))
        lines.extend(textwrap.wrap(printable, width, drop_whitespace=False) or [""])
    return lines


def _progress(args: argparse.Namespace, total: int, unit: str = "cells") -> ProgressBar:
    enabled = sys.stderr.isatty() if args.progress is None else args.progress
    return ProgressBar(total, enabled=enabled, unit=unit)


def _lab_checks(args: argparse.Namespace) -> int:
    """What can be refused before any request: the plot's format, the grid's SPECs and those of the
    model's name (`NAME@SPEC`) against them; the number of (scaling, rule) configurations (an
    axis the name sets counts one)."""
    if args.plot is not None:
        check_plot_path(args.plot)
    check_grid(args.scalings, args.attentions, args.model)
    return len(configurations(args.scalings or ["none"], args.attentions))


def _run_sweep(args: argparse.Namespace) -> int:
    grid = _lab_checks(args)
    if args.corpus is not None:
        text = corpus_text(args.corpus)
    elif str(args.text_file) == "-":
        text = sys.stdin.read()
    else:
        text = args.text_file.read_text(encoding="utf-8")
    bar = _progress(args, grid * len(set(args.lengths)))

    async def run() -> SweepResult:
        async with _lab_client(args) as client:
            return await async_sweep(
                client,
                text=text,
                lengths=args.lengths,
                scalings=args.scalings,
                attentions=args.attentions,
                model=args.model,
                concurrency=args.concurrency,
                on_cell=bar.advance,
            )

    result = asyncio.run(run())
    print(result.model_dump_json() if args.json else sweep_table(result))
    if args.plot is not None:
        plot_sweep(result, args.plot)
    return 0


def _run_passkey(args: argparse.Namespace) -> int:
    grid = _lab_checks(args)
    bar = _progress(args, grid * len(set(args.lengths)) * len(args.depths) * max(1, args.trials))

    async def run() -> PasskeyResult:
        async with _lab_client(args) as client:
            return await async_passkey(
                client,
                lengths=args.lengths,
                depths=args.depths,
                scalings=args.scalings,
                attentions=args.attentions,
                model=args.model,
                trials=args.trials,
                seed=args.seed,
                concurrency=args.concurrency,
                on_cell=bar.advance,
            )

    result = asyncio.run(run())
    print(result.model_dump_json() if args.json else passkey_table(result))
    if args.plot is not None:
        plot_passkey(result, args.plot)
    return 0


def _run_ruler(args: argparse.Namespace) -> int:
    tasks = check_tasks(args.tasks)
    grid = _lab_checks(args)
    haystack = None if args.haystack == "noise" else _read_text(Path(args.haystack), "--haystack")
    bar = _progress(args, grid * len(tasks) * len(set(args.lengths)) * max(1, args.samples), "samples")

    async def run() -> RulerResult:
        async with _lab_client(args) as client:
            return await async_ruler(
                client,
                lengths=args.lengths,
                tasks=tasks,
                samples=args.samples,
                scalings=args.scalings,
                attentions=args.attentions,
                model=args.model,
                seed=args.seed,
                haystack=haystack,
                concurrency=args.concurrency,
                on_sample=bar.advance,
            )

    result = asyncio.run(run())
    print(result.model_dump_json() if args.json else ruler_table(result))
    if args.dump is not None:
        with args.dump.open("w", encoding="utf-8") as dump:
            dump.writelines(sample.model_dump_json() + "\n" for sample in result.samples)
    if args.plot is not None:
        plot_ruler(result, args.plot)
    return 0


def _read_text(path: Path, option: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PEServeError(f"{option} {path}: {exc}") from exc


def _run_models(args: argparse.Namespace) -> int:
    with _client(args) as client:
        for model in client.models():
            print(
                f"{model.name:<24} {model.scheme:<11} native {model.native_context:<6} "
                f"max {model.max_context:<7} {model.device}/{model.dtype}  "
                f"scalings: {','.join(model.supported_scalings)}  "
                f"attention: {','.join(model.supported_attention)}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
