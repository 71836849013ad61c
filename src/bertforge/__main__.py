from bertforge.cli import run

run()
