"""A training run: built in one place (`assembly`: models, teacher, anchors, engine, optimizer, the
checkpoint it starts from), stepped in another (`trainer`: the loop and the step, top to bottom),
checkpointed (`checkpoint`), measured (`metrics`, `evaluate`, `outcomes`) in a folder one writer owns
(`folder`); `evalsuite` is `emapg eval`, the same evaluation for any saved model."""
