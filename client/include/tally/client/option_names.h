// ClientOptions by the names of the environment variables that configure
// them (TALLY_POOL, TALLY_RANK, ...; docs/configuration.md), for callers
// that hold options as name/value strings: the C API's tally_options_set and
// the Python module's keyword arguments.
#pragma once

#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "tally/client/client.h"

namespace tally {

// Sets the field that the environment variable `name` configures, parsing
// `value` as client_options_from_env() does (an empty value leaves the
// field as it is, as an empty variable counts as unset). Does not validate
// the whole set: connect() does. Errors: kInvalidArgument naming the
// variable (an unknown name, a malformed value).
Status set_client_option(ClientOptions& options, std::string_view name, std::string_view value);

// Every name set_client_option() accepts, in the order in which the
// environment applies them (FI_PROVIDER before TALLY_FABRIC_PROVIDER, which
// wins).
const std::vector<std::string_view>& client_option_names();

// The environment as client_options_from_env() reads it, applied to
// `options`: every name of client_option_names() that is set and, where
// TALLY_RANK, TALLY_WORLD_SIZE or TALLY_JOB is not, what a launcher sets:
// RANK and WORLD_SIZE (torchrun, Kubeflow's PyTorchJob), and
// "<TORCHELASTIC_RUN_ID>-<TORCHELASTIC_RESTART_COUNT>" (torchrun), so each
// elastic incarnation is a job of its own. The TALLY_* names given a value
// are added to `given`. Errors: as set_client_option's, naming the variable
// read.
Status apply_environment(ClientOptions& options, std::set<std::string>& given);

// The options a client cannot go without (TALLY_POOL, TALLY_JOB, TALLY_RANK,
// TALLY_WORLD_SIZE) that are not in `given`, in that order.
std::vector<std::string> missing_required(const std::set<std::string>& given);

}  // namespace tally
