"""Models and the devices they run on: the model zoo (`zoo`: built-in, local and tiny test models, a
distillation teacher fitted to the policy), what emapg needs of a Hugging Face causal LM (`lm`), one
log-prob pass over a micro-batch (`forward`), sharding over processes (`distributed`) and the memory
plan of a run (`plan`)."""
