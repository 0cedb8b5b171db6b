"""``python -m supervisor.console --spool DIR --config FILE --fd N [--node NAME]``: the
console's process, as the daemon starts it (``supervisor.console.process``).

It serves on the listening socket ``--fd`` (bound by the daemon), reads the config the
daemon accepted (``--config``; SIGHUP reads it again), takes the store's URL, when there
is one, through the credentials pipe (``worker.credentials``: never in its environment or
its command line), and says ``console_ready`` (or why it cannot serve, in one line) on
standard output, which the daemon reads. TERM or INT end it; it also dies with the daemon.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import signal
import socket
import sys
from pathlib import Path

from supervisor.console import console_url
from supervisor.console.app import Announcer, Console
from supervisor.console.server import WORKERS, ConsoleServer, tls_context
from supervisor.console.tokens import token_store
from supervisor.stores import open_shared
from worker import credentials
from worker.config import Config, load_config
from worker.descendants import dies_with
from worker.errors import AgentdError
from worker.spool import Spool


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m supervisor.console")
    parser.add_argument("--spool", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--node")
    parser.add_argument("--parent", type=int, required=True)
    return parser


async def serve(spool: Spool, config: Config, config_path: Path, sock: socket.socket) -> int:
    announce = Announcer(sys.stdout)
    host, port = sock.getsockname()[:2]
    console_config = config.console
    context = tls_context(console_config) if console_config.tls else None
    address = console_config.address
    with concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="console") as pool:
        console = Console(
            spool,
            config,
            host=address[0] if address else str(host),
            port=int(port),
            tokens=token_store(spool),
            announce=announce,
            pool=pool,
        )
        server = ConsoleServer(console, sock, context)
        await server.start()
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, done.set)

        def reload() -> None:  # the daemon accepted a new config: its listen is the same
            try:
                new = load_config(config_path)
                if context is not None and new.console.tls:  # (a renewed certificate)
                    tls_context(new.console)  # (checked whole first: a bad pair changes nothing)
                    context.load_cert_chain(str(new.console.tls_cert), str(new.console.tls_key))
                console.reconfigure(new)
            except (AgentdError, OSError, ValueError) as exc:
                announce.error("reload", exc)

        loop.add_signal_handler(signal.SIGHUP, reload)
        announce.ready(console_url(console_config, int(port)))
        await done.wait()
        await server.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    held = credentials.take_over()  # first of all: the store's URL, through the pipe
    args = _parser().parse_args(argv)
    dies_with(args.parent)()  # the daemon's end is this process's
    try:
        config_path = Path(args.config)
        config = load_config(config_path)
        spool = Spool(Path(args.spool))
        if (url := held.get(credentials.STORE)) is not None:
            spool = spool.on(open_shared(url, node=args.node, lease=config.cluster.lease))
        sock = socket.socket(fileno=args.fd)
        try:
            return asyncio.run(serve(spool, config, config_path, sock))
        finally:
            if spool.shared is not None:
                spool.shared.close()
    except AgentdError as exc:
        Announcer(sys.stdout).failed_to_start(str(exc))
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
