"""The config of a run: its schema, its loading, and the user code it names.

- schema      the root Config and the checks that span sections
- training    the sections that say what to train (run, model, data, optimizers, scheduler, train, eval)
- system      the sections that say how the run is carried out (cluster, checkpoint, compression, metrics, security)
- checks      ConfigError and the helpers that name the field, the value and the fix
- loading     YAML, CMEMI__ environment and --set overrides, a typed build of the schema; dump_config
- lookup      user code by import path ('module:attr'), a failed lookup listing the choices
- plugins     building what the config names: model, optimizer, scheduler, param groups
- initweights model.init_from: pretrained weights, checked name by name
- pretrained  model.init_from on a Hugging Face save_pretrained directory: shards by their index, tied weights
- usercode    an error raised in user code, said in one line with where
- extras      optional dependencies, a missing one named with its extra
"""
