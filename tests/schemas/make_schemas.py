"""Rebuilds the schema files of this folder from their upstream files (see README.md).

    python tests/schemas/make_schemas.py K8S_DEFINITIONS_JSON JOBSET_CRD_YAML

Both outputs keep the upstream schemas as they are, minus their ``description`` texts (most of
the bytes), and the Kubernetes file keeps only the definitions that a Job, a Service and a
StatefulSet reach.
"""

import json
import pathlib
import sys

import yaml

HERE = pathlib.Path(__file__).parent
ROOTS = ("io.k8s.api.batch.v1.Job", "io.k8s.api.core.v1.Service", "io.k8s.api.apps.v1.StatefulSet")


def without_descriptions(node):
    """The schema with every ``description`` text dropped (a property named so is kept)."""
    if isinstance(node, dict):
        return {k: without_descriptions(v) for k, v in node.items()
                if not (k == "description" and isinstance(v, str))}
    if isinstance(node, list):
        return [without_descriptions(v) for v in node]
    return node


def refs(node):
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"].rsplit("/", 1)[-1]
        for value in node.values():
            yield from refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from refs(value)


def reachable(definitions: dict, roots) -> dict:
    keep, todo = {}, list(roots)
    while todo:
        name = todo.pop()
        if name not in keep:
            keep[name] = definitions[name]
            todo.extend(refs(keep[name]))
    return dict(sorted(keep.items()))


def write(path: pathlib.Path, schema: dict) -> None:
    path.write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")


def main(definitions_path: str, crd_path: str) -> None:
    definitions = json.loads(pathlib.Path(definitions_path).read_text())["definitions"]
    write(HERE / "kubernetes-v1.30.0-strict.json",
          {"definitions": without_descriptions(reachable(definitions, ROOTS))})
    crd = yaml.safe_load(pathlib.Path(crd_path).read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
    write(HERE / "jobset-v1alpha2.json",
          without_descriptions(version["schema"]["openAPIV3Schema"]))


if __name__ == "__main__":
    main(*sys.argv[1:])
