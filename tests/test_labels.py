"""One label scheme (``app.labels``) answers every binary-versus-K-classes question: no module
outside it branches on the number of classes, and each scheme gives the answers the trainer,
predict and evaluate relied on."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

from app.config import Config
from app.labels import BINARY, BinaryLabels, ClassLabels, label_scheme, scheme_of_names
from app.losses import BCEDiceLoss, CEDiceLoss
from app.precision import ops as fp32_ops

APP = Path(__file__).resolve().parents[1] / "app"
CLASS_NAMES = {"classes", "num_classes", "class_names", "n_classes"}
# asking the label scheme is the way to branch: what its functions are given is not a branch
ASKS_THE_SCHEME = {"label_scheme", "scheme_of_names", "name_problems"}


def mentions_classes(node: ast.AST) -> bool:
    if isinstance(node, ast.Call):
        func = node.func
        called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        if called in ASKS_THE_SCHEME:
            return False
    if isinstance(node, ast.Name) and node.id in CLASS_NAMES:
        return True
    if isinstance(node, ast.Attribute) and node.attr in CLASS_NAMES:
        return True
    return any(mentions_classes(child) for child in ast.iter_child_nodes(node))


def is_guard(node: ast.AST) -> bool:
    """``if <wrong>: raise ...``: a check of an argument, not a binary-versus-K path."""
    return isinstance(node, ast.If) and not node.orelse and isinstance(node.body[-1], ast.Raise)


def class_branches(source: str, where: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
            tests = [node.test]
        elif isinstance(node, ast.BoolOp):
            tests = [node]
        elif isinstance(node, ast.comprehension):
            tests = node.ifs
        else:
            continue
        if is_guard(node):
            continue
        for test in tests:
            if mentions_classes(test):
                line = ast.get_source_segment(source, test).splitlines()[0]
                found.append(f"{where}:{node.lineno}: {line}")
    return found


def test_no_branch_on_the_number_of_classes_outside_the_label_scheme():
    branches = [
        line
        for path in sorted(APP.rglob("*.py"))
        if path.name != "labels.py"
        for line in class_branches(path.read_text(), str(path.relative_to(APP.parent)))
    ]
    assert not branches, "ask app.labels instead:\n" + "\n".join(branches)


def test_the_branch_finder_sees_the_usual_forms():
    source = (
        "a = 1 if cfg.num_classes >= 2 else 0\n"
        "if classes:\n    pass\n"
        "b = len(classes) or 1\n"
        "if num_classes < 2:\n    raise ValueError('a guard')\n"
        "c = label_scheme(cfg.num_classes) or 2\n"
    )
    assert sorted(line.split(":")[1] for line in class_branches(source, "x.py")) == ["1", "2", "4"]


def test_each_scheme_answers_for_its_task():
    binary, k3 = label_scheme(1), label_scheme(3, ("bg", "pore", "ore"))
    assert isinstance(binary, BinaryLabels) and binary is BINARY and isinstance(k3, ClassLabels)
    assert (binary.head_channels, k3.head_channels) == (1, 3)
    assert (binary.names, k3.names) == ([], ["bg", "pore", "ore"])
    assert label_scheme(3).names == ["class0", "class1", "class2"]
    assert (binary.scored, k3.scored) == (["foreground"], ["pore", "ore"])
    assert isinstance(binary.loss(1.0, 1.0), BCEDiceLoss)
    assert isinstance(k3.loss(1.0, 1.0), CEDiceLoss)
    assert Config(num_classes=3).labels.names == Config(num_classes=3).classes
    assert scheme_of_names([]) is BINARY and scheme_of_names(k3.names).num_classes == 3
    assert binary.output_kinds(("probs", "mask")) == ("probs", "mask")
    assert k3.output_kinds(("probs", "mask")) == ("probs_bg", "probs_pore", "probs_ore", "mask")
    assert (binary.train_flags, k3.train_flags) == ("", " --num-classes 3")


def test_probabilities_are_fp32_through_the_registry():
    logits = torch.randn(1, 3, 2, 4, 4, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        probs = label_scheme(3).probabilities(logits)
        sig = BINARY.probabilities(logits[:, :1])
    assert probs.dtype == sig.dtype == torch.float32
    assert torch.equal(probs, fp32_ops.softmax(logits, dim=1)[0])
    assert torch.equal(BINARY.mask_of_logits(logits[0, :1]), logits[0, 0] > 0)
    assert torch.equal(label_scheme(3).mask_of_logits(logits[0]), logits[0].argmax(0))


def test_output_arrays_of_each_scheme():
    probs = np.array([[[0.2, 0.7]]], np.float32)
    arrays = BINARY.output_arrays(probs)
    assert arrays["mask"].tolist() == [[[0, 1]]] and arrays["probs"] is probs
    maps = label_scheme(2, ("bg", "fg")).output_arrays(np.stack([1 - probs, probs]))
    assert maps["mask"].tolist() == [[[0, 1]]] and set(maps) == {"mask", "probs_bg", "probs_fg"}
    with pytest.raises(ValueError, match="clean binary masks"):
        label_scheme(2).check_mask_cleaning(True, "best.pt")
    BINARY.check_mask_cleaning(True, "best.pt")
