"""Publishing to the Hugging Face Hub: `bertforge export RUN --push-to-hub ORG/NAME`, and the pushes that
`pretrain` and `finetune` make of every N-th checkpoint with `--hub.repo ORG/NAME --hub.every N`.

The token is huggingface_hub's own business (HF_TOKEN, or what `hf auth login` stored): bertforge never reads it,
so it cannot reach a file or a log. During training the upload runs on a thread of its own: a push due while
another is still uploading waits for it, a newer one replaces a waiting one, and a failed push is a warning; the
next push sends the newer model. Training never waits for a push except for the last one, at the end.
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any


def repo_problem(repo: str) -> str | None:
    """Why the Hub would refuse `repo` as a model repository name, or None when it is a valid one."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        return str(e).splitlines()[0]
    return None


@dataclasses.dataclass(frozen=True)
class HubConfig:
    repo: str = ""  # ORG/NAME (or NAME) of a model repository to push checkpoints to; empty: no pushes
    every: int = 1  # push every N-th checkpoint (and the final model)
    private: bool = False  # create the repository private
    revision: str = ""  # branch to push to (made when missing); default: main
    language: tuple[str, ...] = ()  # the model card's languages (ISO 639-1 codes such as en, ja)
    datasets: tuple[str, ...] = ()  # the model card's datasets (Hub dataset ids)
    license: str = ""  # the model card's license (a Hub license id such as apache-2.0)

    def __post_init__(self) -> None:
        problem = repo_problem(self.repo) if self.repo else None
        if problem is not None:
            raise ValueError(f"hub.repo {self.repo!r} is not a repository name the Hub accepts ({problem})")
        if self.every < 1:
            raise ValueError(f"hub.every must be at least 1, got {self.every}")

    def card(self) -> dict[str, Any]:
        """The model card's metadata this section gives (card.model_card's language, datasets and license)."""
        return {"language": self.language, "datasets": self.datasets, "license": self.license}

    def due(self, step: int, checkpoint_every: int) -> bool:
        """Whether the checkpoint of `step` (one every `checkpoint_every` steps) is also pushed."""
        return bool(self.repo) and (step // checkpoint_every) % self.every == 0


def push_folder(
    folder: str | Path,
    repo: str,
    *,
    private: bool = False,
    revision: str = "",
    message: str = "",
    path_in_repo: str = "",
) -> str:
    """Upload `folder` to model repository `repo` (created when missing; `revision` a branch, made when missing) in
    one commit; returns the commit's URL."""
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo, private=private, exist_ok=True)
    if revision and revision != "main":
        api.create_branch(repo, branch=revision, exist_ok=True)
    info = api.upload_folder(
        repo_id=repo,
        folder_path=str(folder),
        path_in_repo=path_in_repo or None,
        revision=revision or None,
        commit_message=message or f"Upload {Path(folder).name} with bertforge",
    )
    return str(info.commit_url)


def _warn(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


@dataclasses.dataclass
class _Job:
    folder: Path
    message: str
    path_in_repo: str


class Publisher:
    """Pushes export folders to `cfg.repo` from a thread of its own, so that training goes on meanwhile.

    `submit` hands over a folder that is then the publisher's: it is deleted once pushed or replaced. At most one
    push runs and one waits; a folder submitted while one waits takes its place (the newer model is the one to
    publish). `close` waits for the running and the waiting push."""

    def __init__(self, cfg: HubConfig, say: Callable[[str], None] = _warn, push: Callable[..., str] = push_folder):
        self.cfg, self.say, self.push = cfg, say, push
        self.pushed: list[str] = []  # the messages of the pushes that succeeded
        self.failed: list[str] = []
        self._waiting: _Job | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._work, name="hub-push", daemon=True)
        self._thread.start()

    def submit(self, folder: Path, message: str, path_in_repo: str = "") -> None:
        with self._cond:
            if self._waiting is not None:
                shutil.rmtree(self._waiting.folder, ignore_errors=True)
            self._waiting = _Job(Path(folder), message, path_in_repo)
            self._cond.notify()

    def _work(self) -> None:
        while True:
            with self._cond:
                while self._waiting is None and not self._closed:
                    self._cond.wait()
                job, self._waiting = self._waiting, None
            if job is None:
                return
            try:
                url = self.push(
                    job.folder,
                    self.cfg.repo,
                    private=self.cfg.private,
                    revision=self.cfg.revision,
                    message=job.message,
                    path_in_repo=job.path_in_repo,
                )
                self.pushed.append(job.message)
                self.say(f"pushed to the Hub: {job.message} ({url})")
            except Exception as e:  # any failure of the network or the Hub: the next push tries again
                reason = (str(e).splitlines() or [type(e).__name__])[0]
                self.failed.append(job.message)
                with self._cond:
                    last = self._closed and self._waiting is None
                then = (
                    "it was the last one: `bertforge export RUN --push-to-hub` publishes the model"
                    if last
                    else "the next push will try again"
                )
                self.say(f"warning: the push of {job.message} to {self.cfg.repo} failed ({reason}); {then}")
            finally:
                shutil.rmtree(job.folder, ignore_errors=True)

    def close(self, wait: bool = True) -> None:
        """Stop taking pushes; with `wait`, return once the running and the waiting one are done. Without, a push
        still running dies with the process: the Hub keeps a commit whole or not at all."""
        with self._cond:
            self._closed = True
            if not wait and self._waiting is not None:
                shutil.rmtree(self._waiting.folder, ignore_errors=True)
                self._waiting = None
            self._cond.notify()
        if wait:
            self._thread.join()


STAGING = ".hub"  # RUN/.hub/NAME (or FOLD/.hub/NAME): exports waiting for their push to the Hub


def clear_staging(folder: Path) -> None:
    """Delete the exports a killed run had not pushed yet (process 0, as a run starts)."""
    shutil.rmtree(Path(folder) / STAGING, ignore_errors=True)


def open_publisher(cfg: HubConfig, say: Callable[[str], None] = _warn) -> Publisher | None:
    """Process 0's publisher when `cfg` names a repository, else None."""
    import jax

    return Publisher(cfg, say) if cfg.repo and jax.process_index() == 0 else None


def stage(
    publisher: Publisher, folder: Path, name: str, write: Callable[[Path], None], message: str, path_in_repo: str = ""
) -> None:
    """`write` an export into the staging folder FOLDER/.hub/NAME and hand it to `publisher`, which deletes it."""
    staged = Path(folder) / STAGING / name
    write(staged)
    publisher.submit(staged, message, path_in_repo)


def copy_of(source: Path) -> Callable[[Path], None]:
    """A `write` for `stage` that copies the folder `source` (an export already written)."""
    return functools.partial(_copy_folder, Path(source))


def _copy_folder(source: Path, folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(source, folder)


def finish(publisher: Publisher | None, say: Callable[[str], None]) -> None:
    """Training is over: wait for the last push, saying so."""
    if publisher is not None:
        say(f"waiting for the last push to {publisher.cfg.repo} to finish")
        publisher.close()


def abandon(publisher: Publisher | None) -> None:
    """Stop pushing without waiting (after `finish`, a no-op)."""
    if publisher is not None:
        publisher.close(wait=False)  # stopped by a signal or an error: no waiting on the network
