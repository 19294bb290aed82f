"""Any registry.yaml, kernel.yaml, metadata.json, signature or lock file either loads or raises a
KernelHubError naming the file (and the line and field where the text has them): never another
exception type, never a hang.

Inputs are arbitrary text, arbitrary bytes on disk, valid documents with characters spliced in,
and valid documents with values swapped for arbitrary JSON/YAML values, keys dropped or added.
Examples per test are bounded (``EXAMPLES``) so the file runs in well under a minute.
"""

from __future__ import annotations

import base64
import collections
import copy
import json
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernel_hub.errors import KernelHubError, SourceError
from kernel_hub.hub.lockfile import read_lock
from kernel_hub.hub.metadata import read_metadata
from kernel_hub.hub.signing import generate_key_pair, read_signature, verify_signature
from kernel_hub.paths import BUILTIN_DIR
from kernel_hub.registry.manifest import parse_manifest
from kernel_hub.registry.publisher_keys import PublisherKeys
from kernel_hub.registry.registry import parse_registry

EXAMPLES = 150
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=3000,  # ms: a parser that takes seconds on a small input counts as a hang
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=True,  # the same examples on every run: CI failures reproduce
)
WHERE = Path("/fuzz/input")
ERRORS: collections.Counter = collections.Counter()  # clean refusals per parser, for the report

_KEY = "ed25519:" + base64.b64encode(bytes(range(32))).decode()
_DIGEST = base64.b64encode(bytes(32)).decode()
_REGISTRY = (BUILTIN_DIR / "registry.yaml").read_text() + (
    f"publishers:\n  kernel-hub:\n    keys: [{_KEY}]\n    revoked: []\n"
)
_MANIFEST = (BUILTIN_DIR / "kernels" / "rmsnorm" / "kernel.yaml").read_text()
_METADATA = {
    "id": "rmsnorm_1_0_0_torch_cpu_abcd",
    "name": "rmsnorm",
    "version": 1,
    "license": "Apache-2.0",
    "python-depends": [],
    "backend": {"type": "cpu"},
    "digest": {"algorithm": "sha256", "files": {"rmsnorm/__init__.py": _DIGEST}},
    "kernel-hub": {
        "version": "1.0.0",
        "variant": "torch-cpu",
        "framework": "torch",
        "package": "rmsnorm",
        "requires": {"jax": ">=0.7"},
        "ops": ["rms_norm"],
        "layers": ["RMSNorm"],
        "implementations": ["xla"],
    },
}
_SIGNATURE = {
    "kernel-hub-signature": 1,
    "signed": {"repo": "kernel-hub/rmsnorm", "version": "1.0.0", "variant": "torch-cpu",
               "metadata": _DIGEST},
    "key": "ed25519:0123456789abcdef",
    "signature": base64.b64encode(bytes(64)).decode(),
}  # fmt: skip
_LOCK = {
    "kernel-hub-lock": 1,
    "ops": {
        "rmsnorm": {
            "repo": "kernel-hub/rmsnorm",
            "version": "1.0.0",
            "commit": "a" * 40,
            "variants": {"torch-cpu": {"metadata.json": _DIGEST, "rmsnorm/api.py": _DIGEST}},
        }
    },
}

scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=8,
)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _paths(value, (*prefix, index))


@st.composite
def mutated(draw, document):
    """``document`` with 1-3 random edits: a value replaced, a key dropped, a key added."""
    doc = copy.deepcopy(document)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(list(_paths(doc))))
        if not path:
            return draw(values)
        parent = doc
        for part in path[:-1]:
            parent = parent[part]
        action = draw(st.sampled_from(["replace", "drop", "add"]))
        if action == "drop" and isinstance(parent, dict):
            del parent[path[-1]]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.text(max_size=8))] = draw(values)
        else:
            parent[path[-1]] = draw(values)
    return doc


@st.composite
def spliced(draw, text: str):
    """``text`` with a slice replaced by arbitrary characters."""
    start = draw(st.integers(0, len(text)))
    end = draw(st.integers(start, min(len(text), start + 40)))
    return text[:start] + draw(st.text(max_size=20)) + text[end:]


def _check(parse, text: str) -> None:
    """Loads, or raises a SourceError naming the file (and a line inside it, when it has one)."""
    try:
        parse(WHERE, text)
    except SourceError as exc:
        assert exc.path == str(WHERE) and str(exc).startswith(str(WHERE)), exc
        assert exc.line is not None and 1 <= exc.line <= text.count("\n") + 1, exc
        ERRORS[parse.__name__] += 1


PARSERS = {
    "registry": (parse_registry, _REGISTRY, "yaml"),
    "manifest": (parse_manifest, _MANIFEST, "yaml"),
    "metadata": (read_metadata, json.dumps(_METADATA, indent=2), "json"),
    "signature": (read_signature, json.dumps(_SIGNATURE, indent=2), "json"),
    "lock": (read_lock, json.dumps(_LOCK, indent=2), "json"),
}
DOCUMENTS = {
    "registry": yaml.safe_load(_REGISTRY),
    "manifest": yaml.safe_load(_MANIFEST),
    "metadata": _METADATA,
    "signature": _SIGNATURE,
    "lock": _LOCK,
}


@pytest.mark.parametrize("kind", sorted(PARSERS))
def test_valid_documents_load(kind):
    parse, text, _ = PARSERS[kind]
    parse(WHERE, text)


@pytest.mark.parametrize("kind", sorted(PARSERS))
@FUZZ
@given(data=st.data())
def test_arbitrary_text(kind, data):
    parse, _, _ = PARSERS[kind]
    _check(parse, data.draw(st.text(max_size=200)))


@pytest.mark.parametrize("kind", sorted(PARSERS))
@FUZZ
@given(data=st.data())
def test_spliced_documents(kind, data):
    parse, text, _ = PARSERS[kind]
    _check(parse, data.draw(spliced(text)))


@pytest.mark.parametrize("kind", sorted(PARSERS))
@FUZZ
@given(data=st.data())
def test_mutated_documents(kind, data):
    parse, _, syntax = PARSERS[kind]
    doc = data.draw(mutated(DOCUMENTS[kind]))
    try:
        text = yaml.safe_dump(doc) if syntax == "yaml" else json.dumps(doc, indent=2)
    except (ValueError, yaml.YAMLError):
        return  # not representable (NaN in JSON is, inf keys are not): nothing to parse
    _check(parse, text)


@pytest.mark.parametrize("kind", ["metadata", "signature", "lock"])
@FUZZ
@given(raw=st.binary(max_size=200))
def test_arbitrary_bytes_on_disk(kind, raw, tmp_path):
    parse = PARSERS[kind][0]
    path = tmp_path / f"{kind}.json"
    path.write_bytes(raw)
    try:
        parse(path)
    except SourceError as exc:
        assert exc.path == str(path)


@pytest.fixture(scope="module")
def signed_folder(tmp_path_factory):
    """A snapshot folder whose metadata.json is signed by a key made for this run."""
    from kernel_hub.hub.signing import SigningKey, signature_path

    root = tmp_path_factory.mktemp("signed")
    pair = generate_key_pair(root / "key")
    variant = root / "build" / "torch-cpu"
    variant.mkdir(parents=True)
    (variant / "metadata.json").write_text(json.dumps(_METADATA))
    sig = SigningKey(pair.private_path).sign_variant(
        variant, "kernel-hub/rmsnorm", "1.0.0", "torch-cpu"
    )
    (root / "signatures").mkdir()
    (root / signature_path("torch-cpu")).write_bytes(sig)
    return root, PublisherKeys("kernel-hub", (pair.public_key,)), json.loads(sig)


def test_fuzz_signature_baseline_verifies(signed_folder):
    from kernel_hub.hub.signing import signature_path

    root, keys, _ = signed_folder
    signature = root / signature_path("torch-cpu")
    verified = verify_signature(
        signature, metadata_bytes(root), repo="kernel-hub/rmsnorm", variant="torch-cpu", keys=keys
    )
    assert verified.version == "1.0.0"


def metadata_bytes(root):
    return (root / "build" / "torch-cpu" / "metadata.json").read_bytes()


@FUZZ
@given(data=st.data())
def test_mutated_signatures_never_verify_and_fail_cleanly(signed_folder, data):
    from kernel_hub.hub.signing import signature_path

    root, keys, document = signed_folder
    doc = data.draw(mutated(document))
    path = root / signature_path("torch-cpu")
    original = path.read_bytes()
    try:
        path.write_text(json.dumps(doc))
        verified = verify_signature(path, metadata_bytes(root), repo="kernel-hub/rmsnorm",
                                    variant="torch-cpu", keys=keys)  # fmt: skip
        assert verified.version == "1.0.0"  # the version is part of what was signed
    except KernelHubError:
        pass
    else:  # only edits that leave the signed bytes and the key id as they were may verify
        assert doc["signature"] == document["signature"] and doc["key"] == document["key"]
    finally:
        path.write_bytes(original)


def test_report_refusals(capsys):
    """Prints how many fuzzed inputs each parser refused (all with file and line); runs last."""
    with capsys.disabled():
        print(f"\nfuzz: inputs refused with file and line, per parser: {dict(ERRORS)}")
