/*
 * torchpass.so: the TorchPass SPANK plugin.
 *
 * Adds --torchpass[=aware|transparent|auto] and --torchpass-spares=N to sbatch, salloc and srun.
 * In the client (local/allocator context) it exports TORCHPASS=<mode>, TORCHPASS_SPARES=<n> and
 * SLURM_NO_KILL=set into the environment the job inherits, and records the same in the job-control
 * environment that prolog/epilog scripts see. In remote context (slurmstepd) it puts the shim
 * directory (plugstack argument shimdir=DIR) first on each task's PATH, so `torchrun` runs launchpad,
 * and gives each task the site's TorchPass config (plugstack argument config=FILE) as
 * TORCHPASS_CONFIG: the job script itself sets nothing.
 *
 * Job-level --no-kill cannot be set from SPANK; spank/cli_filter.lua does that (see spank/README.md).
 * Uses only the stable SPANK API (spank_option_register in slurm_spank_init: an exported option
 * table alone is ignored by sbatch/salloc on 22.05), so it builds against 22.05 and 24.11 headers.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <slurm/spank.h>

SPANK_PLUGIN(torchpass, 1);

#define OPT_MODE 1
#define OPT_SPARES 2
#define MAX_SPARES 1024

static int enabled;
static char mode[16] = "auto";
static long spares;
static char shimdir[4096];
static char config[4096];

static int set_mode(const char *arg)
{
	/* A bare --torchpass reaches sruns inside the job through SLURM_SPANK_* as "(null)". */
	if (arg == NULL || arg[0] == '\0' || !strcmp(arg, "(null)"))
		arg = "auto";
	if (strcmp(arg, "aware") && strcmp(arg, "transparent") && strcmp(arg, "auto")) {
		slurm_error("torchpass: --torchpass=%s: mode must be aware, transparent or auto", arg);
		return ESPANK_BAD_ARG;
	}
	snprintf(mode, sizeof(mode), "%s", arg);
	return ESPANK_SUCCESS;
}

static int set_spares(const char *arg)
{
	char *end = NULL;
	long n;

	errno = 0;
	n = arg ? strtol(arg, &end, 10) : -1;
	if (arg == NULL || errno || end == arg || *end != '\0' || n < 0 || n > MAX_SPARES) {
		slurm_error("torchpass: --torchpass-spares=%s: give a whole number of nodes from 0 to %d",
			    arg ? arg : "", MAX_SPARES);
		return ESPANK_BAD_ARG;
	}
	spares = n;
	return ESPANK_SUCCESS;
}

static int option_cb(int val, const char *optarg, int remote)
{
	int rc = (val == OPT_MODE) ? set_mode(optarg) : set_spares(optarg);

	if (rc == ESPANK_SUCCESS)
		enabled = 1;   /* --torchpass-spares=N alone also means "run under TorchPass" */
	return rc;
}

static struct spank_option options[] = {
	{ "torchpass", "[aware|transparent|auto]",
	  "Run this job under TorchPass: training ranks are live-migrated off failing nodes "
	  "(mode: aware = save/load hooks, transparent = process capture, auto = pick; default auto)",
	  2, OPT_MODE, (spank_opt_cb_f) option_cb },
	{ "torchpass-spares", "N",
	  "Keep N nodes of this allocation as TorchPass hot spares (implies --torchpass)",
	  1, OPT_SPARES, (spank_opt_cb_f) option_cb },
};

int slurm_spank_init(spank_t sp, int ac, char **av)
{
	size_t i;
	int a;

	for (i = 0; i < sizeof(options) / sizeof(options[0]); i++) {
		spank_err_t rc = spank_option_register(sp, &options[i]);

		if (rc != ESPANK_SUCCESS) {
			slurm_error("torchpass: cannot register --%s: %s", options[i].name, spank_strerror(rc));
			return -1;
		}
	}
	for (a = 0; a < ac; a++) {
		if (!strncmp(av[a], "shimdir=", 8)) {
			snprintf(shimdir, sizeof(shimdir), "%s", av[a] + 8);
		} else if (!strncmp(av[a], "config=", 7)) {
			snprintf(config, sizeof(config), "%s", av[a] + 7);
		} else {
			slurm_error("torchpass: unknown plugstack.conf argument '%s' (known: shimdir=DIR config=FILE)",
				    av[a]);
			return -1;
		}
	}
	return 0;
}

/* Client side: what the job inherits, and what prolog/epilog scripts see. */
int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
	char n[24];
	spank_context_t ctx = spank_context();

	if (!enabled || (ctx != S_CTX_LOCAL && ctx != S_CTX_ALLOCATOR))
		return 0;
	snprintf(n, sizeof(n), "%ld", spares);
	if (spank_job_control_setenv(sp, "TORCHPASS", mode, 1) != ESPANK_SUCCESS ||
	    spank_job_control_setenv(sp, "TORCHPASS_SPARES", n, 1) != ESPANK_SUCCESS)
		slurm_error("torchpass: cannot record the mode for prolog/epilog scripts");
	/* The client's environment is copied into the job: steps started inside it (srun) then
	 * run with --no-kill, so one failing node ends only its own tasks, not the whole step. */
	setenv("TORCHPASS", mode, 1);
	setenv("TORCHPASS_SPARES", n, 1);
	setenv("SLURM_NO_KILL", "set", 1);   /* srun accepts "set", not "1" */
	slurm_verbose("torchpass: job runs under TorchPass (mode=%s spares=%ld)", mode, spares);
	return 0;
}

/* Put dir first on the task's variable var (a colon-separated list), unless it is already. */
static void prepend(spank_t sp, const char *var, const char *dir)
{
	char old[8192], value[sizeof(old) + 4096 + 2];
	size_t len = strlen(dir);

	if (spank_getenv(sp, var, old, sizeof(old)) != ESPANK_SUCCESS)
		old[0] = '\0';
	if (!strncmp(old, dir, len) && (old[len] == ':' || old[len] == '\0'))
		return;   /* already first: an srun inside a --torchpass batch job */
	snprintf(value, sizeof(value), "%s%s%s", dir, old[0] ? ":" : "", old);
	if (spank_setenv(sp, var, value, 1) != ESPANK_SUCCESS)
		slurm_error("torchpass: cannot put %s first on %s", dir, var);
}

/* Remote side: every task of a TorchPass step finds the shim's torchrun first on PATH, and its
 * Python the shim's start-up hook (python/sitecustomize.py: `python -m torch.distributed.run`
 * and a torchrun given by its full path run launchpad too). */
int slurm_spank_task_init(spank_t sp, int ac, char **av)
{
	char pydir[sizeof(shimdir) + 8], n[24];
	size_t len = strlen(shimdir);

	if (!enabled || !spank_remote(sp))
		return 0;
	snprintf(n, sizeof(n), "%ld", spares);
	spank_setenv(sp, "TORCHPASS", mode, 1);
	spank_setenv(sp, "TORCHPASS_SPARES", n, 1);
	/* launchpad reads the site's config (broker, timeouts) from here; without config= it falls
	 * back to /etc/torchpass/torchpass.toml. */
	if (config[0] && spank_setenv(sp, "TORCHPASS_CONFIG", config, 1) != ESPANK_SUCCESS)
		slurm_error("torchpass: cannot set TORCHPASS_CONFIG=%s", config);
	if (len == 0) {
		slurm_error("torchpass: no shimdir= in plugstack.conf: torchrun is not replaced by launchpad");
		return 0;
	}
	prepend(sp, "PATH", shimdir);
	snprintf(pydir, sizeof(pydir), "%s/python", shimdir);
	prepend(sp, "PYTHONPATH", pydir);
	return 0;
}
