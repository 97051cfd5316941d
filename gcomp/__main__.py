from gcomp.cli import run

run()
