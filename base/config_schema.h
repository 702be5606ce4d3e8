// The configuration schema's document mechanics that the typed reading (base/config.cpp) builds on; the public
// functions over the schema (config-keys, --set, the closest key) are declared in config.h.
#pragma once

#include "base/json.h"

namespace trainer {

// A user's config document checked against the schema (every key known, of its type and range; a misspelt key
// named with the closest one), returned with every default filled in (in evaluators[] and data.sources[] items too)
// and the required keys present.
Json complete_config_document(const Json& user_doc);

}  // namespace trainer
