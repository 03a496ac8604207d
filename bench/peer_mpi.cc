// tally-peer-mpi: the bench's sweep through MPI_Allreduce (float32 sum, in
// place), one rank per process as mpirun starts them, for tally-bench
// --compare. The driver runs it with OpenMPI's tcp btl only (--mca btl
// tcp,self), so it crosses the same kernel TCP path tally does.
// The C API only (no C++ bindings: they need libmpi_cxx).
#define OMPI_SKIP_MPICXX 1
#include <mpi.h>

#include <CLI/CLI.hpp>
#include <string>

#include "peer_sweep.h"
#include "tally/protocol/version.h"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  // Errors come back as codes rather than aborting the job.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  tally::bench::PeerSweep sweep;
  CLI::App app{
      "tally-peer-mpi: all-reduce sweeps through MPI_Allreduce, for tally-bench --compare"};
  app.set_version_flag("--version", "tally-peer-mpi " + tally::version_string());
  tally::bench::add_sweep_options(app, sweep);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    MPI_Finalize();
    return code;
  }
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  auto describe = [](int rc) {
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, text, &len);
    return std::string(text, static_cast<size_t>(len));
  };
  tally::bench::PeerComm comm;
  comm.rank = static_cast<uint32_t>(rank);
  comm.world = static_cast<uint32_t>(size);
  comm.allreduce = [&](float* data, size_t count, std::string* error) {
    const int rc = MPI_Allreduce(MPI_IN_PLACE, data, static_cast<int>(count), MPI_FLOAT, MPI_SUM,
                                 MPI_COMM_WORLD);
    if (rc != MPI_SUCCESS) *error = describe(rc);
    return rc == MPI_SUCCESS;
  };
  comm.sum = [&](double* data, size_t count, std::string* error) {
    const int rc = MPI_Allreduce(MPI_IN_PLACE, data, static_cast<int>(count), MPI_DOUBLE, MPI_SUM,
                                 MPI_COMM_WORLD);
    if (rc != MPI_SUCCESS) *error = describe(rc);
    return rc == MPI_SUCCESS;
  };
  // Open MPI picks its algorithm per size (coll tuned); the ring's bus
  // factor is the nccl-tests convention for all of them.
  const double busbw = size > 1 ? 2.0 * (size - 1) / size : 1.0;
  const int result = tally::bench::run_peer_sweep(sweep, comm, "mpi", busbw);
  MPI_Finalize();
  return result;
}
