"""`python -m minidecode ...` runs the `minidecode` command, so that `torchrun --nproc-per-node N -m
minidecode generate ...` starts one process per rank. The command lives in the top-level cli.py
(installed as minidecode_cli.cli), which imports the package: only this entry point, never the
package itself, imports the CLI."""

from minidecode_cli.cli import main

if __name__ == "__main__":
    main()
