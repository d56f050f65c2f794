"""The ``exllama-integrations`` command: demo, generate, prepare-demo, serve."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from .errors import ExLlamaIntegrationsError

DEMO_QUESTION = "What is the capital of France?"


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="auto", help="auto, exllamav3, exllama, transformers (default: auto)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--min-p", type=float)
    p.add_argument("--repetition-penalty", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--max-seq-len", type=int, help="context/cache length to allocate")
    p.add_argument("--threads", type=int, help="CPU threads of the CPU reference backend (default: cores - 1)")


def _format_names() -> str:
    from .chat.formats import FORMATS

    return ", ".join(FORMATS)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Help that shows each option's default, where it has one and its text does not say it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS, []) or "default" in text:
            return text
        return super()._get_help_string(action) or text


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``exllama-integrations`` command."""
    from . import __version__

    formatter = _Help
    parser = argparse.ArgumentParser(prog="exllama-integrations", description=__doc__, formatter_class=formatter)
    parser.add_argument("--version", action="version", version=f"exllama-integrations {__version__}")
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="log what the runtime does (and one line per request)",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log what the runtime does (and one line per request)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, parents=[verbose], formatter_class=formatter)

    d = add("demo", "prepare the demo model (SmolLM2-135M-Instruct) and answer a question")
    d.add_argument("prompt", nargs="?", default=DEMO_QUESTION)
    _sampling_flags(d)

    g = add("generate", "complete a prompt with any model directory")
    g.add_argument("--model-dir", required=True)
    g.add_argument("--chat", action="store_true", help="send the prompt as a user turn through the chat template")
    g.add_argument("prompt")
    _sampling_flags(g)

    pd = add("prepare-demo", "download and convert the demo model, print its directory")
    pd.add_argument(
        "--embedding", action="store_true", help="also prepare the demo embedding model (all-MiniLM-L6-v2, 83 MB)"
    )

    sv = add("serve", "an OpenAI-compatible HTTP server over one loaded model, or several (or Ray Serve replicas)")
    sv.add_argument(
        "model",
        nargs="*",
        help="model directory or Hub id, as vLLM takes it (or --model-dir); several: each loads on its first request "
        "(docs/multi-model.md)",
    )
    sv.add_argument(
        "--config",
        metavar="FILE",
        help="a TOML, YAML or JSON file naming the models to serve, each with its backend, options, pinning, "
        "keep_alive and kind, and the memory budget (docs/multi-model.md)",
    )
    sv.add_argument("--gpu-memory", metavar="SIZE", help="several models: GPU memory they load within (e.g. 20GiB)")
    sv.add_argument("--ram", metavar="SIZE", help="several models: memory they load within (default: 90%% available)")
    sv.add_argument(
        "--keep-alive",
        metavar="DURATION",
        help="several models: how long a model stays loaded after its last request (5m, 0, -1: for ever; default 5m)",
    )
    sv.add_argument(
        "--model-dir",
        "--model",
        action="append",
        default=[],
        metavar="DIR",
        help="model directory or Hub id (default: the demo model); given again, another model served beside it",
    )
    sv.add_argument("--backend", default="auto", help="auto, exllamav3, exllama, exllamav2, transformers")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    sv.add_argument("--port", type=int, default=8000, help="port to listen on")
    sv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set EXLLAMA_API_KEY)")
    sv.add_argument("--served-model-name", help="the model name clients use (default: the directory's name)")
    sv.add_argument("--max-seq-len", "--max-model-len", type=int, help="context/cache length to allocate")
    sv.add_argument("--dtype", help="weights dtype, for backends that take one (CPU reference: float32)")
    sv.add_argument("--chat-template", help="a chat template (a file, or jinja text) instead of the model's own")
    sv.add_argument(
        "--tool-format",
        metavar="NAME",
        help="read and write tool calls in this family's format instead of the one found in the chat template "
        "(as tool_format= does in process): one of " + _format_names(),
    )
    sv.add_argument(
        "--timeout-keep-alive", type=float, help="seconds an idle connection stays open (default: 5; not with --ray)"
    )
    sv.add_argument(
        "--max-connections", type=int, help="connections at once; more get 503 (default: 1024; not with --ray)"
    )
    sv.add_argument("--max-tokens", type=int, help="most tokens each generation may make (each choice of a request)")
    sv.add_argument(
        "--max-pending", type=int, default=256, help="generations in flight at once (prompts x n each); more get 503"
    )
    sv.add_argument("--max-body-bytes", type=int, default=8 * 2**20, help="largest request body; larger get 413")
    sv.add_argument("--body-timeout", type=float, default=30.0, help="seconds to send a whole body; slower get 408")
    sv.add_argument(
        "--header-timeout", type=float, help="seconds to send a request's headers (default: 10; not with --ray)"
    )
    sv.add_argument(
        "--allow-image-urls",
        action="store_true",
        help="fetch http(s) image URLs in chat requests (10 s in all, 20 MB, no redirects), from global addresses "
        "only (not loopback, private or link-local) unless --image-url-allow lists them; off: data: URLs only",
    )
    sv.add_argument(
        "--image-url-allow",
        action="append",
        default=[],
        metavar="HOST_OR_NETWORK",
        help="with --allow-image-urls: a host name or network (10.0.0.0/8) an image may be fetched from although it "
        "is not a global address (repeatable)",
    )
    sv.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a backend load option, e.g. cache_size=65536 (repeatable; values parsed as JSON)",
    )
    sv.add_argument(
        "--draft",
        choices=("mtp",),
        help="speculative decoding with the checkpoint's own multi-token-prediction heads (exllamav3: the option "
        "draft='mtp'; a checkpoint without them is refused at load); tokens a step: --option num_draft_tokens=N",
    )
    sv.add_argument(
        "--engine",
        choices=("process", "thread"),
        default="process",
        help="where the model's driver runs: an engine process of its own (HTTP and JSON never share its Python), "
        "or a thread of the server",
    )
    sv.add_argument(
        "--engines",
        type=int,
        default=1,
        help="engine processes, each with its own copy of the model and cache, sharing the GPU (with the default "
        "decode='fast' two served 0.62-0.90x of one on an H200: keep 1 unless one engine leaves the GPU idle; "
        "costs the model's memory again per engine)",
    )
    sv.add_argument(
        "--kind",
        choices=("chat", "embedding", "rerank"),
        help="what the model is (default: from its files: a sentence-transformers model is an embedding model, a "
        "classification head a rerank model, else chat); embedding and rerank models serve /v1/embeddings and "
        "/v1/rerank (a causal LM becomes one: last-token pooling, or its yes/no logits)",
    )
    sv.add_argument(
        "--task",
        choices=("generate", "embed", "rerank"),
        help="deprecated: --kind's old name (generate, embed, rerank: chat, embedding, rerank); warns",
    )
    sv.add_argument("--ray", action="store_true", help="serve through Ray Serve replicas (extra 'ray')")
    sv.add_argument("--replicas", type=int, default=1, help="with --ray: number of replicas")
    sv.add_argument("--num-gpus", type=float, help="with --ray: GPUs per replica (default 1 on CUDA, else 0)")

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        if args.command == "prepare-demo":
            from .demo_model import demo_model_dir

            print(demo_model_dir())
            if args.embedding:
                from .demo_embedding import embedding_model_dir

                print(embedding_model_dir())
        elif args.command == "serve":
            from .serve.launch import serve_command

            return serve_command(args)
        elif args.command == "demo":
            from .demo_model import demo_model_dir
            from .generate_command import llm_of, run_chain

            path = demo_model_dir()
            print(f"loading the demo model ({path.name}) ...", file=sys.stderr)
            llm = llm_of(str(path), args, chat=True)
            run_chain(llm, "{question}", {"question": args.prompt})
        else:
            from .generate_command import llm_of, run_chain

            run_chain(llm_of(args.model_dir, args, chat=args.chat), "{text}", {"text": args.prompt})
    except ExLlamaIntegrationsError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
