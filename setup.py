"""Build hook only (the project is described in pyproject.toml): a built package carries the
commit it was built from, so results measured with an installed copy can name their code."""
import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildPyWithCommit(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return  # an editable install runs from the checkout, which names its own commit
        # Loaded by path: importing the package would import torch.
        spec = importlib.util.spec_from_file_location("_results", HERE / "pagedserve/benchmark/results.py")
        results = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(results)
        commit = results._checkout_commit(HERE / "pagedserve")
        if commit is not None:  # not built from a checkout: no stamp, and results refuse to be written
            results.write_stamp(Path(self.build_lib) / "pagedserve", commit)


setup(cmdclass={"build_py": BuildPyWithCommit})
