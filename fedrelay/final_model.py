"""The fetched final model: a safetensors file that says what it is, and how to load it.

The sites produce and exchange the final model as plain safetensors bytes
(``fedrelay.tensors.encode_state``: the tensors and ``{"format": "pt"}`` only), so that its SHA-256,
the digest the ledger records, depends on the weights alone. ``coordinator fetch-model`` writes
the same tensors, byte for byte, under a header that also carries this metadata (all values
strings, as safetensors requires):

=========================  ====================================================================
``fedrelay.task``          the run's task (e.g. ``image-folder``), which builds the model
``fedrelay.task_version``  the task's version the sites reported
``fedrelay.task_sha256``   the SHA-256 of the task's code every site ran
``fedrelay.model``         the task's model (e.g. ``cnn``, ``resnet18``)
``fedrelay.input``         the sites' common input description (JSON), e.g. ``{"channels": 1,
                           "height": 28, "width": 28}`` for image-folder
``fedrelay.class_names``   the class names in logit order (JSON list): logit ``i`` is class ``i``
``fedrelay.run_id``        the run that trained it
``fedrelay.strategy``      the run's strategy
``fedrelay.final_sha256``  the ledger's digest of the final model (the sites' file)
``fedrelay.version``       the fedrelay version that wrote the file
=========================  ====================================================================

The fetched file's own SHA-256 therefore differs from ``fedrelay.final_sha256``; the tensors
are the same, and :func:`load_model` checks that they are: it re-encodes them as the sites did
and compares that digest with ``fedrelay.final_sha256``.

Only :func:`load_model` imports torch; adding the metadata (:func:`with_metadata`) rewrites the
header alone, so the coordinator's CLI stays free of torch.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from fedrelay import safetensors_header
from fedrelay.task import ModelSpec, canonical_json
from fedrelay.tensors import decode_state, encode_state
from fedrelay.version import __version__

PREFIX = "fedrelay."
# gRPC metadata key of the coordinator's FetchModel reply: the run's ModelSpec as JSON
# (fedrelay.ModelSpec.to_dict()), for the file's metadata.
MODEL_SPEC_METADATA = "fedrelay-model-spec"
KEYS = ("task", "task_version", "task_sha256", "model", "input", "class_names", "run_id", "strategy",
        "final_sha256", "version")
OPTIONAL = ("task_version", "task_sha256", "version")


class ModelFileError(ValueError):
    """A file that is not a fedrelay final model, or whose tensors do not match its digest."""


def _split(data: bytes) -> tuple[dict, bytes]:
    """safetensors bytes -> (header dict, the tensor data after the header)."""
    try:
        return safetensors_header.split(data)
    except safetensors_header.HeaderError as exc:
        raise ModelFileError(str(exc)) from None


def with_metadata(data: bytes, metadata: dict[str, str]) -> bytes:
    """``data`` (a safetensors file's bytes) with ``metadata`` added to its header's
    ``__metadata__`` (string keys and values; existing keys are kept unless overwritten). The
    tensor bytes are copied unchanged (their offsets are relative to the end of the header);
    the header is padded with spaces to a multiple of 8 bytes, as safetensors writes it.
    Raises ``ModelFileError`` for bytes that are not safetensors."""
    header, body = _split(data)
    meta = dict(header.get("__metadata__") or {})
    meta.update({str(k): str(v) for k, v in metadata.items()})
    header["__metadata__"] = meta
    return safetensors_header.join(header, body)


def describe(*, spec: dict, class_names, run_id: str, strategy: str, final_sha256: str) -> dict[str, str]:
    """The metadata of a final model (module docstring), as safetensors' strings; ``spec``: the
    run's ``fedrelay.ModelSpec.to_dict()``."""
    return {PREFIX + "task": spec["task"], PREFIX + "task_version": spec.get("task_version", ""),
            PREFIX + "task_sha256": spec.get("task_sha256", ""), PREFIX + "model": spec["model"],
            PREFIX + "input": canonical_json(spec.get("input") or {}),
            PREFIX + "class_names": json.dumps(list(class_names)), PREFIX + "run_id": run_id,
            PREFIX + "strategy": strategy, PREFIX + "final_sha256": final_sha256, PREFIX + "version": __version__}


def read_metadata(path: str | Path) -> dict:
    """The fedrelay metadata of a final model file: ``task``, ``task_version``, ``task_sha256``,
    ``model`` (str), ``input`` (dict), ``class_names`` (list of str), ``run_id``, ``strategy``,
    ``final_sha256``, ``version``. A file fetched by an older fedrelay (``arch`` and
    ``input_shape``) reads as the image-folder task's.
    Reads the header only. Raises ``ModelFileError`` for a file without it (e.g. a model file
    taken from a site's state dir: fetch it with ``coordinator fetch-model``), ``OSError`` if
    it cannot be read."""
    path = Path(path)
    try:
        header = safetensors_header.read_header(path)
    except safetensors_header.HeaderError as exc:
        raise ModelFileError(f"{path}: {exc}") from None
    meta = (header.get("__metadata__") or {}) if isinstance(header, dict) else {}
    if PREFIX + "arch" in meta and PREFIX + "task" not in meta:  # written before tasks existed
        try:
            c, h, w = json.loads(meta[PREFIX + "input_shape"])
        except (ValueError, TypeError, KeyError):
            raise ModelFileError(f"{path}: malformed fedrelay metadata (input_shape)") from None
        meta = {**meta, PREFIX + "task": "image-folder", PREFIX + "model": meta[PREFIX + "arch"],
                PREFIX + "input": json.dumps({"channels": c, "height": h, "width": w})}
    missing = [PREFIX + k for k in KEYS if PREFIX + k not in meta and k not in OPTIONAL]
    if missing:
        raise ModelFileError(f"{path} has no fedrelay metadata ({', '.join(missing)} missing): it is not a final model "
                             "written by `coordinator fetch-model RUN -o FILE` (a site's model file carries only "
                             "tensors); fetch the run's final model with that command")
    try:
        out = {k: meta.get(PREFIX + k, "") for k in KEYS}
        out["input"] = json.loads(out["input"])
        out["class_names"] = [str(c) for c in json.loads(out["class_names"])]
        if not isinstance(out["input"], dict):
            raise ValueError("input must be a JSON object")
    except (ValueError, TypeError) as exc:
        raise ModelFileError(f"{path}: malformed fedrelay metadata: {exc}") from None
    return out


def original_sha256(path: str | Path) -> str:
    """The SHA-256 of the file's tensors encoded as the sites encoded them
    (``fedrelay.tensors.encode_state``): for a fetched final model, the ledger's digest of the run's
    final model (``fedrelay.final_sha256``). Imports torch. Raises ``ModelFileError`` for a file
    that is not safetensors."""
    try:
        state = decode_state(Path(path).read_bytes())
    except ValueError as exc:
        raise ModelFileError(f"{path}: {exc}") from None
    return hashlib.sha256(encode_state(state)).hexdigest()


def load_model(path: str | Path, device: str = "cpu", *, verify: bool = True):
    """Load a final model written by ``coordinator fetch-model``: ``(model, class_names)``.

    ``model`` is a ``torch.nn.Module`` built by the run's task (which must be installed here:
    ``fedrelay.tasks``; its digest is not required to be the run's) on ``device``, in eval mode,
    with the run's weights; it maps a batch as the task feeds it (``Task.batch``: for
    image-folder, float32 images ``N x C x H x W`` with pixel values in ``[0, 1]``) to float32
    logits ``N x K``. ``class_names``: the K class names in logit order.

    ``verify``: re-encode the tensors as the sites did (``fedrelay.tensors.encode_state``) and check
    that their SHA-256 is the ledger's digest ``fedrelay.final_sha256`` (the encoding is
    deterministic for a given safetensors version).

    Raises ``ModelFileError`` (a ``ValueError``) for a file without fedrelay's metadata, tensors
    that do not fit the architecture, or (with ``verify``) tensors that do not match the digest;
    ``OSError`` when the file cannot be read.
    """
    import torch  # only here: reading and writing the metadata stays free of torch

    from fedrelay.models import build_model  # imports torch

    path = Path(path)
    meta = read_metadata(path)
    try:
        state = decode_state(path.read_bytes())
    except ValueError as exc:
        raise ModelFileError(f"{path}: {exc}") from None
    if verify:
        digest = hashlib.sha256(encode_state(state)).hexdigest()
        if digest != meta["final_sha256"]:
            raise ModelFileError(f"{path}: its tensors encode to sha256 {digest}, not the run's final model "
                                 f"{meta['final_sha256']} (a damaged or altered file; pass verify=False to load "
                                 "it anyway)")
    spec = ModelSpec(task=meta["task"], model=meta["model"], num_classes=len(meta["class_names"]),
                     input_json=canonical_json(meta["input"]), task_version=meta["task_version"])
    try:
        model = build_model(spec)
        model.load_state_dict(state, strict=True)
    except (ValueError, RuntimeError, LookupError, ImportError) as exc:
        raise ModelFileError(f"{path}: the tensors do not fit task {spec.task}'s model {spec.model} for input "
                             f"{spec.input_json} and {spec.num_classes} classes: {exc}") from None
    model.eval()
    return model.to(torch.device(device)), meta["class_names"]
