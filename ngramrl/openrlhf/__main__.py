"""python -m ngramrl.openrlhf [openrlhf.cli.train_ppo_ray arguments] [--ngramrl.NAME VALUE ...]"""

from __future__ import annotations

import runpy
import sys


def main(argv: list[str] | None = None) -> int:
    from ngramrl.openrlhf import UnsupportedVersion
    from ngramrl.openrlhf.patch import install, split_args

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        options, openrlhf_args = split_args(argv)
        integration = install(options)
    except (ValueError, UnsupportedVersion) as err:
        print(f"ngramrl.openrlhf: error: {err}", file=sys.stderr)
        return 2
    sys.argv = ["openrlhf.cli.train_ppo_ray", *openrlhf_args]
    try:
        runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)
    finally:
        if integration is not None:
            integration.uninstall()
    return 0


if __name__ == "__main__":
    sys.exit(main())
