"""Adapters between the embedding spaces of two models that were not trained to be compatible.

All adapters share one interface: ``fit(source, target)`` on paired features of the same images (row ``i`` of both
arrays embeds image ``i``), ``apply(features)``, ``loss(source, target)``, ``state_dict()`` / :func:`adapter_from_state`
(safetensors-compatible tensors plus string metadata; :func:`save_adapter` / :func:`load_adapter_bytes`).

Directions (what ``source`` and ``target`` are):

- query adapters map the **new** model's query features into the **old** model's space, so new queries search the
  old, un-re-indexed gallery: ``procrustes`` (orthogonal Procrustes), ``affine`` (low-rank affine, reduced-rank
  ridge regression), ``mlp`` (residual MLP);
- the gallery transformations map the **old** model's gallery features into the **new** model's space, so the
  gallery is upgraded without re-running the new model on its images: ``fct`` (FCT-style, Ramanujan et al. 2022,
  GELU MLP) and ``fan`` (FAN's psi, Iscen et al. 2020: Linear-ReLU-Linear). Trained adapters are fitted by ``fit``
  on paired features (the FAN method fits its ``fan`` adapter after each model update). Adapters chain (:func:`apply_chain`): FAN maps a gallery of model
  k into model t's space through psi_{k+1}, ..., psi_t.

Features are L2-normalised before fitting and before applying (retrieval is by cosine similarity); outputs are not
normalised (the retrieval code does that). MLP adapters minimise the mean squared L2 error
``(1/n) * sum_i ||f(x_i) - y_i||^2`` with Adam; training is seeded and runs on the device of the inputs.
"""
from __future__ import annotations

import json
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from compat_core.kinds import ADAPTER_KINDS, GALLERY_ADAPTERS, QUERY_ADAPTERS

SEEDED_ADAPTERS = ("mlp", "fct", "fan")             # trained by gradient descent: take a ``seed``
_FORMAT = "compat-adapter/1"


def _as_float_matrix(name: str, value: Any) -> torch.Tensor:
    tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    if tensor.ndim != 2 or tensor.shape[0] == 0 or tensor.shape[1] == 0:
        raise ValueError(f"{name}: expected a non-empty (N, D) feature matrix, got shape {tuple(tensor.shape)}")
    tensor = tensor.float()
    if not torch.isfinite(tensor).all():
        raise ValueError(f"{name}: features contain NaN or infinity")
    return tensor


def _paired(source: Any, target: Any) -> tuple[torch.Tensor, torch.Tensor]:
    x = _as_float_matrix("source", source)
    y = _as_float_matrix("target", target)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"paired features: source has {x.shape[0]} rows, target {y.shape[0]}; row i of both must "
                         "embed the same image")
    return F.normalize(x, dim=1), F.normalize(y, dim=1)


class Adapter:
    """Interface shared by all adapters. ``direction``: 'query' (new -> old) or 'gallery' (old -> new)."""

    kind = ""
    direction = "query"

    def __init__(self) -> None:
        self.fit_loss: list[float] = []

    def fit(self, source: Any, target: Any) -> "Adapter":  # pragma: no cover - interface
        raise NotImplementedError

    def _map(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def apply(self, features: Any) -> torch.Tensor:
        """Map (N, D_source) features (normalised here first) to (N, D_target) float32 features."""
        x = F.normalize(_as_float_matrix("features", features), dim=1)
        with torch.no_grad():
            return self._map(x).float()

    def loss(self, source: Any, target: Any) -> float:
        """Mean squared L2 error ``(1/n) sum_i ||f(x_i) - y_i||^2`` on normalised paired features."""
        x, y = _paired(source, target)
        with torch.no_grad():
            return float(((self._map(x) - y) ** 2).sum(dim=1).mean())

    def state_dict(self) -> dict[str, torch.Tensor]:  # pragma: no cover - interface
        raise NotImplementedError

    def metadata(self) -> dict[str, str]:
        return {"format": _FORMAT, "kind": self.kind, "direction": self.direction,
                "fit_loss": json.dumps(self.fit_loss[-1:] and self.fit_loss[-1])}


class ProcrustesAdapter(Adapter):
    """Orthogonal Procrustes: ``W = argmin_{W^T W = I} ||X W - Y||_F = U V^T`` with ``U S V^T = svd(X^T Y)``.

    Solved in float64. With different widths ``W`` is semi-orthogonal (``D_source x D_target``).
    """

    kind = "procrustes"

    def __init__(self) -> None:
        super().__init__()
        self.weight: torch.Tensor | None = None

    def fit(self, source: Any, target: Any) -> "ProcrustesAdapter":
        x, y = _paired(source, target)
        u, _, vh = torch.linalg.svd(x.double().T @ y.double(), full_matrices=False)
        self.weight = (u @ vh).float()
        self.fit_loss = [self.loss(x, y)]
        return self

    def _map(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.to(x.device)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight.contiguous()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.weight = state["weight"].float()


class AffineAdapter(Adapter):
    """Low-rank affine map ``y = (x - mu_x) A B + mu_y`` by reduced-rank ridge regression.

    ``W = (X_c^T X_c + ridge * n * I)^{-1} X_c^T Y_c`` (centred), then projected on the top ``rank`` right singular
    vectors ``V_r`` of the fitted values ``X_c W``: ``A = W V_r`` (D_source x r), ``B = V_r^T`` (r x D_target).
    """

    kind = "affine"

    def __init__(self, rank: int = 64, ridge: float = 1e-3) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"affine adapter rank: expected >= 1, got {rank}")
        if ridge < 0:
            raise ValueError(f"affine adapter ridge: expected >= 0, got {ridge}")
        self.rank, self.ridge = int(rank), float(ridge)
        self.tensors: dict[str, torch.Tensor] = {}

    def fit(self, source: Any, target: Any) -> "AffineAdapter":
        x, y = _paired(source, target)
        x64, y64 = x.double(), y.double()
        mu_x, mu_y = x64.mean(dim=0), y64.mean(dim=0)
        xc, yc = x64 - mu_x, y64 - mu_y
        gram = xc.T @ xc + self.ridge * x.shape[0] * torch.eye(x.shape[1], dtype=torch.float64)
        weight = torch.linalg.solve(gram, xc.T @ yc)
        _, _, vh = torch.linalg.svd(xc @ weight, full_matrices=False)
        rank = min(self.rank, vh.shape[0])
        v_r = vh[:rank].T
        self.tensors = {"a": (weight @ v_r).float(), "b": v_r.T.float().contiguous(), "mu_x": mu_x.float(),
                        "mu_y": mu_y.float(), "rank": torch.tensor([rank])}
        self.fit_loss = [self.loss(x, y)]
        return self

    def _map(self, x: torch.Tensor) -> torch.Tensor:
        t = {name: value.to(x.device) for name, value in self.tensors.items()}
        return (x - t["mu_x"]) @ t["a"] @ t["b"] + t["mu_y"]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: value.contiguous() for name, value in self.tensors.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.tensors = {name: value for name, value in state.items()}
        self.rank = int(state["rank"][0])


class _MlpNet(nn.Module):
    """``x -> [x S +] Linear2(GELU(Linear1(x)))``; ``S`` is the identity (equal widths) or a learned linear skip."""

    def __init__(self, d_in: int, d_out: int, hidden: int, residual: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_out)
        self.residual = residual
        self.skip = nn.Linear(d_in, d_out, bias=False) if residual and d_in != d_out else None
        if residual:  # start at the identity (or the skip) so training refines it
            nn.init.zeros_(self.fc2.weight)
            nn.init.zeros_(self.fc2.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc2(F.gelu(self.fc1(x)))
        if self.residual:
            out = out + (self.skip(x) if self.skip is not None else x)
        return out


class TrainedAdapter(Adapter):
    """An adapter that is a small network trained by gradient descent on the mean squared L2 error.

    ``build(d_in, d_out)`` creates the network (initial weights drawn from torch's global generator);
    ``objective(x, y)`` is the differentiable loss on normalised paired features, shared by ``fit`` (Adam, seeded)
    and by any method that trains an adapter jointly with its model.
    """

    def __init__(self, hidden: int = 512, epochs: int = 30, lr: float = 1e-3, batch_size: int = 256,
                 weight_decay: float = 1e-4, seed: int = 0) -> None:
        super().__init__()
        for name, value in (("hidden", hidden), ("epochs", epochs), ("batch_size", batch_size)):
            if int(value) < 1:
                raise ValueError(f"{self.kind} adapter {name}: expected >= 1, got {value}")
        if lr <= 0:
            raise ValueError(f"{self.kind} adapter lr: expected > 0, got {lr}")
        self.hidden, self.epochs, self.lr = int(hidden), int(epochs), float(lr)
        self.batch_size, self.weight_decay, self.seed = int(batch_size), float(weight_decay), int(seed)
        self.net: nn.Module | None = None
        self.widths = (0, 0)

    def _network(self, d_in: int, d_out: int) -> nn.Module:  # pragma: no cover - interface
        raise NotImplementedError

    def build(self, d_in: int, d_out: int) -> nn.Module:
        """Create the (d_in -> d_out) network from torch's global generator; returns it for an optimizer."""
        self.widths = (int(d_in), int(d_out))
        self.net = self._network(int(d_in), int(d_out))
        return self.net

    def objective(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Differentiable ``(1/n) sum_i ||f(x_i) - y_i||^2`` (x, y: normalised rows; computed in float32)."""
        return ((self.net(x).float() - y) ** 2).sum(dim=1).mean()

    def fit(self, source: Any, target: Any, progress: Callable[[int, int, float], None] | None = None
            ) -> "TrainedAdapter":
        """Adam on :meth:`objective`; ``progress(epoch, epochs, epoch_loss)`` after each epoch."""
        x, y = _paired(source, target)
        generator = torch.Generator().manual_seed(self.seed)
        torch_state = torch.random.get_rng_state()
        torch.manual_seed(self.seed)
        self.build(x.shape[1], y.shape[1]).to(x.device)
        torch.random.set_rng_state(torch_state)
        optimizer = torch.optim.Adam(self.net.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        self.fit_loss = []
        for epoch in range(self.epochs):
            order = torch.randperm(x.shape[0], generator=generator).to(x.device)
            total = 0.0
            for start in range(0, x.shape[0], self.batch_size):
                index = order[start:start + self.batch_size]
                loss = self.objective(x[index], y[index])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                total += float(loss.detach()) * index.numel()
            self.fit_loss.append(total / x.shape[0])
            if progress is not None:
                progress(epoch + 1, self.epochs, self.fit_loss[-1])
        self.net.eval()
        return self

    def _map(self, x: torch.Tensor) -> torch.Tensor:
        return self.net.to(x.device)(x)

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {name: value.detach().cpu().contiguous() for name, value in self.net.state_dict().items()}
        state["shape"] = torch.tensor([self.widths[0], self.widths[1], self.hidden])
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        d_in, d_out, hidden = (int(v) for v in state["shape"])
        self.hidden = hidden
        self.build(d_in, d_out)
        self.net.load_state_dict({name: value for name, value in state.items() if name != "shape"})
        self.net.eval()


class ResidualMlpAdapter(TrainedAdapter):
    """New -> old query adapter ``f(x) = x + W2 GELU(W1 x + b1) + b2`` (identity at initialisation)."""

    kind = "mlp"

    def _network(self, d_in: int, d_out: int) -> nn.Module:
        return _MlpNet(d_in, d_out, self.hidden, residual=True)


class FctAdapter(TrainedAdapter):
    """FCT-style old -> new gallery transformation ``h(x) = W2 GELU(W1 x + b1) + b2`` (no skip: the spaces differ)."""

    kind = "fct"
    direction = "gallery"

    def _network(self, d_in: int, d_out: int) -> nn.Module:
        return _MlpNet(d_in, d_out, self.hidden, residual=False)


class FanAdapter(TrainedAdapter):
    """FAN's adaptation network psi (Iscen et al., ECCV 2020), old -> new gallery: ``W2 ReLU(W1 x + b1) + b2``.

    Tensor names are those of ``nn.Sequential(Linear, ReLU, Linear)`` (``0.weight`` ... ``2.bias``). The FAN
    method fits it with ``fit`` after each model update, on paired features of the old and the updated model.
    """

    kind = "fan"
    direction = "gallery"

    def _network(self, d_in: int, d_out: int) -> nn.Module:
        return nn.Sequential(nn.Linear(d_in, self.hidden), nn.ReLU(inplace=True), nn.Linear(self.hidden, d_out))


# each class names its kind (compat_core.kinds.ADAPTER_KINDS lists them; a test keeps the two equal)
_CLASSES = {cls.kind: cls for cls in (ProcrustesAdapter, AffineAdapter, ResidualMlpAdapter, FctAdapter, FanAdapter)}
# FAN adapters stored before all adapters shared this format: bare Sequential tensors, no metadata
_LEGACY_FAN_TENSORS = {"0.weight", "0.bias", "2.weight", "2.bias"}


def make_adapter(kind: str, **params: Any) -> Adapter:
    """A fresh adapter of ``kind`` (one of ADAPTER_KINDS) with ``params`` (rank/ridge or hidden/epochs/lr/...)."""
    if kind not in _CLASSES:
        raise ValueError(f"adapter {kind!r}: expected one of {list(ADAPTER_KINDS)}")
    return _CLASSES[kind](**params)


def save_adapter(adapter: Adapter) -> bytes:
    """safetensors bytes of the adapter's tensors, kind and direction in the metadata."""
    from safetensors.torch import save

    return save(adapter.state_dict(), metadata=adapter.metadata())


def adapter_from_state(state: dict[str, torch.Tensor], metadata: dict[str, str]) -> Adapter:
    """Adapter from its tensors and metadata (kind, format); a legacy FAN file (bare psi tensors) is read as fan."""
    metadata = dict(metadata or {})
    if not metadata and set(state) == _LEGACY_FAN_TENSORS:
        weight = state["0.weight"]
        state = {**state, "shape": torch.tensor([weight.shape[1], state["2.weight"].shape[0], weight.shape[0]])}
        metadata = {"format": _FORMAT, "kind": "fan"}
    kind = metadata.get("kind")
    if metadata.get("format") != _FORMAT or kind not in _CLASSES:
        raise ValueError(f"adapter file: expected metadata format {_FORMAT!r} and kind in {list(ADAPTER_KINDS)}, "
                         f"got {metadata!r}")
    adapter = _CLASSES[kind].__new__(_CLASSES[kind])
    Adapter.__init__(adapter)
    adapter.load_state_dict(state)
    return adapter


def apply_chain(features: Any, adapters: list[Adapter]) -> torch.Tensor:
    """Apply ``adapters`` in order (each normalises its input), then L2-normalise: (N, D) -> (N, D') float32.

    FAN's gallery of model k seen from model t: ``adapters`` = psi_{k+1}, ..., psi_t (oldest first). With no
    adapter the features are just normalised.
    """
    mapped = _as_float_matrix("features", features)
    for adapter in adapters:
        mapped = adapter.apply(mapped)
    return F.normalize(mapped, dim=1)


def load_adapter_bytes(data: bytes) -> Adapter:
    """Adapter from :func:`save_adapter` bytes (safetensors: no pickle; metadata read from the JSON header)."""
    from safetensors.torch import load

    if len(data) < 8:
        raise ValueError("adapter file: too short to be safetensors")
    header_length = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8:8 + header_length].decode("utf-8")).get("__metadata__") or {}
    return adapter_from_state(load(data), metadata)


__all__ = ["ADAPTER_KINDS", "QUERY_ADAPTERS", "GALLERY_ADAPTERS", "SEEDED_ADAPTERS", "Adapter", "ProcrustesAdapter",
           "AffineAdapter", "TrainedAdapter", "ResidualMlpAdapter", "FctAdapter", "FanAdapter", "make_adapter",
           "save_adapter", "load_adapter_bytes", "adapter_from_state", "apply_chain"]
