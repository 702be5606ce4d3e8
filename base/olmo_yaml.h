// OLMo's own YAML configs (allenai/OLMo configs/official/*.yaml), read as OLMo reads them with OmegaConf:
//   1. read_yaml_config: YAML -> the config document. Plain scalars are typed as OmegaConf's YAML loader
//      types them (null, true/false, integers with '_' separators, floats with or without a '.', e.g.
//      4.0e-4 and 3e12); quoted scalars stay strings. ${...} interpolations are kept as written, so that
//      --set overrides and flags replace a value before it is resolved, as OmegaConf's do.
//   2. finish_olmo_config, after the overrides:
//      - resolves ${key.path} (typed when it is the whole value), ${oc.env:VAR[,default]} and OLMo's
//        ${path.choose:a,b,...} (the first path that exists or is a URL; none is an error naming the key)
//        and ${path.glob:pattern,...}, nested ones first;
//      - maps the OLMo structures the trainer spells differently: an evaluator's data.datasets (name ->
//        paths) becomes one evaluator per dataset, eval_subset_num_batches fills each evaluator's
//        subset_num_batches, scheduler.units: tokens turns token counts into steps (refused unless they
//        divide exactly);
//      - keeps tokenizer.identifier as the run's tokenizer, saying on stderr when it is one the trainer
//        lacks; runs a downstream evaluator where its examples exist (its data.paths, else <label>.jsonl in
//        $TRAINER_DOWNSTREAM_DIR, default data/downstream);
//      - removes the OLMo keys that have no effect here (wandb, compile, speed_monitor,
//        tokenizer.truncate_direction, model.flash_attention, data loader settings, downstream evaluators
//        without their files (named with the paths looked for), evaluators whose data are URLs, ...),
//        listing them once in one warning line on stderr; with `strict` they are an error. A
//        key whose value would change what trains (model.alibi: true, a dropout above 0, clip_qkv, ...) is
//        refused by name: the trainer does not do it.
//   Keys OLMo does not have are still refused by validate_config, with the closest key.
#pragma once

#include <string>

#include "base/config.h"

namespace trainer {

// True for a path ending in .yaml or .yml.
bool is_yaml_config_path(const std::string& path);

Json read_yaml_config(const std::string& path);

// Step 2 (base/olmo_keys.cpp), after the overrides.
void finish_olmo_config(Json& doc, const std::string& path, bool strict);

// Step 2's first part: every ${...} of the document resolved in place.
void resolve_olmo_interpolations(Json& doc, const std::string& path);

}  // namespace trainer
