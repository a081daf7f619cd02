"""Validates the Kubernetes examples offline, every document of every manifest:

    python examples/kubernetes/validate.py [FILE.yaml ...]

(default: every *.yaml under this directory). Needs PyPI `kubernetes-validate` (it brings
PyYAML and jsonschema).

- Core kinds (Service, StatefulSet, Job, ...) against Kubernetes' own schemas, strict: an
  unknown field is an error, and so is a kind that has no schema.
- A PyTorchJob (a custom resource, which kubernetes-validate has no schema for): its pod
  templates as core PodTemplates, strict, and the rest against pytorchjob-v1.schema.json,
  the PyTorchJob v1 fields written from Kubeflow training-operator v1.9's CRD and webhook.

Prints one line per document and exits 1 when any fails.
"""
import json
import os
import sys

import jsonschema
import kubernetes_validate
import yaml

KUBERNETES_VERSION = "1.37.0"
HERE = os.path.dirname(os.path.abspath(__file__))
PYTORCHJOB_SCHEMA = os.path.join(HERE, "pytorchjob-v1.schema.json")


def core_errors(doc):
    """Errors of one core object: kubernetes-validate, strict; a kind without a schema fails."""
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = ".".join(str(p) for p in e.path)
        return [f"{path}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [e.message]
    return []


def pytorchjob_errors(doc, schema):
    errors = []
    validator = jsonschema.Draft202012Validator(schema)
    for e in sorted(validator.iter_errors(doc), key=lambda e: list(e.path)):
        path = ".".join(str(p) for p in e.path)
        errors.append(f"{path}: {e.message}")
    spec = doc.get("spec") if isinstance(doc.get("spec"), dict) else {}
    elastic = spec.get("elasticPolicy") or {}
    lo, hi = elastic.get("minReplicas"), elastic.get("maxReplicas")
    if isinstance(lo, int) and isinstance(hi, int) and lo > hi:
        errors.append(f"spec.elasticPolicy: minReplicas {lo} is above maxReplicas {hi}")
    replicas = spec.get("pytorchReplicaSpecs")
    for rtype, rspec in (replicas.items() if isinstance(replicas, dict) else []):
        if not isinstance(rspec, dict) or not isinstance(rspec.get("template"), dict):
            continue
        name = f"{doc.get('metadata', {}).get('name', 'job')}-{str(rtype).lower()}"
        wrapped = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": name},
            "template": rspec["template"],
        }
        for e in core_errors(wrapped):
            errors.append(f"spec.pytorchReplicaSpecs.{rtype}.{e}")
    return errors


def validate_file(path, schema):
    """Returns the number of documents that failed."""
    try:
        with open(path) as f:
            docs = [d for d in yaml.safe_load_all(f) if d is not None]
    except (OSError, yaml.YAMLError) as e:
        print(f"error {path}: {e}")
        return 1
    if not docs:
        print(f"error {path}: no documents")
        return 1
    failed = 0
    for i, doc in enumerate(docs):
        if not isinstance(doc, dict):
            print(f"error {path} document {i}: not a mapping")
            failed += 1
            continue
        kind = doc.get("kind", "?")
        name = (doc.get("metadata") or {}).get("name", "?")
        if doc.get("apiVersion") == "kubeflow.org/v1" and kind == "PyTorchJob":
            errors = pytorchjob_errors(doc, schema)
        else:
            errors = core_errors(doc)
        for e in errors:
            print(f"error {path} {kind}/{name}: {e}")
        if errors:
            failed += 1
        else:
            print(f"ok {path} {kind}/{name}")
    return failed


def main(argv):
    paths = argv or sorted(
        os.path.join(root, f)
        for root, _, files in os.walk(HERE)
        for f in files
        if f.endswith(".yaml")
    )
    with open(PYTORCHJOB_SCHEMA) as f:
        schema = json.load(f)
    failed = sum(validate_file(p, schema) for p in paths)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
