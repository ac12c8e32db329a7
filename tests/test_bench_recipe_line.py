"""Every accuracy section of bench/RESULTS.md names the recipe its figures were trained with
(issue #25), from the section's recorded config."""

from __future__ import annotations

from bench.common import recipe_line, sections_markdown


def test_a_section_names_its_recipe_from_its_config_and_says_when_it_ran_the_defaults():
    old = {"config": {"model": "cnn", "lr": 0.001, "batch_size": 128}}
    line = recipe_line(old)
    assert "learning-rate schedule constant" in line and "augmentation none" in line
    assert "not in the config: the defaults" in line and "model cnn, lr 0.001, batch size 128" in line
    new = {"settings": {"model": "cnn-wide", "lr_schedule": "cosine", "augment": "flip-crop"}}
    assert recipe_line(new) == ("Recipe (from this section's recorded config): learning-rate schedule cosine, "
                                "augmentation flip-crop, model cnn-wide.")
    assert "Recipe (from this section's recorded config)" in "\n".join(sections_markdown({"accuracy": old}))


def test_sections_without_a_model_or_with_a_recipe_per_table_get_no_recipe_line():
    assert recipe_line({"config": {"sites": 10}}) is None
    assert recipe_line({"summary": "transfer speed"}) is None
    assert recipe_line({"config": {"model": "cnn"}, "recipes": {"paper-cnn": {}}}) is None
