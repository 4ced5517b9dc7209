"""`tandem generate`: stream one completion from a tandem frontend to the terminal.

  tandem generate "Once upon a time" --max-tokens 64 --temperature 0
  tandem generate --chat "Write a haiku about gRPC" --server localhost:50050

Text goes to stdout as it arrives; time to first token, token count and decode speed go to stderr at
the end. Exit status 1 (with the gRPC status on stderr) when the call fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import grpc

from frontend_svc.client import TandemClient
from shared_runtime.security.auth import API_KEY_ENV


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", help="the prompt text (a user message with --chat)")
    p.add_argument("--server", default="localhost:50050", help="frontend address host:port")
    p.add_argument("--chat", action="store_true", help="send the prompt as one user chat message")
    p.add_argument("--max-tokens", type=int, default=None, help="default: fill the context window")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--tls", action="store_true", help="connect with TLS (system roots unless --ssl-ca-certs)")
    p.add_argument("--ssl-ca-certs", default=None, help="CA bundle that verifies the server (implies --tls)")
    p.add_argument("--ssl-certfile", default=None, help="client certificate for mutual TLS")
    p.add_argument("--ssl-keyfile", default=None, help="private key of --ssl-certfile")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help=f"sent as 'authorization: Bearer <key>' (default: ${API_KEY_ENV})")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop,
                    ignore_eos=args.ignore_eos or None)
    prompt = {"chat": [{"role": "user", "content": args.prompt}]} if args.chat else {"prompt": args.prompt}
    started = time.perf_counter()
    first_at: float | None = None
    num_tokens = 0
    security = dict(tls=args.tls, ssl_ca_certs=args.ssl_ca_certs, ssl_certfile=args.ssl_certfile,
                    ssl_keyfile=args.ssl_keyfile, api_key=args.api_key)
    with TandemClient(args.server, **security) as client:
        try:
            for response in client.generate(timeout=args.timeout, **prompt, **sampling):
                if first_at is None and response.token_ids:
                    first_at = time.perf_counter()
                num_tokens += len(response.token_ids)
                sys.stdout.write(response.text)
                sys.stdout.flush()
        except grpc.RpcError as exc:
            print(f"\ntandem generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("\ntandem generate: cancelled", file=sys.stderr)
            return 130
    _report(started, first_at, time.perf_counter(), num_tokens)
    return 0


def _report(started: float, first_at: float | None, ended: float, num_tokens: int) -> None:
    print(file=sys.stdout)
    if first_at is None:
        print("no tokens generated", file=sys.stderr)
        return
    decode_s = ended - first_at
    rate = (num_tokens - 1) / decode_s if num_tokens > 1 and decode_s > 0 else float("nan")
    print(f"TTFT {1000 * (first_at - started):.1f} ms | {num_tokens} tokens in {ended - started:.2f} s | "
          f"{rate:.1f} tok/s after the first", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
