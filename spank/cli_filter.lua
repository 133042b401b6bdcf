--[[
TorchPass cli_filter (Slurm's cli_filter/lua plugin; runs inside sbatch, salloc and srun).

SPANK cannot change the job request, so this filter does the two things TorchPass needs from it
for jobs given --torchpass[=MODE] or --torchpass-spares=N (the options torchpass.so registers):
  * --no-kill: a failing node is removed from the job instead of ending it;
  * a marker in the job's comment, "torchpass:mode=MODE,spares=N", which is how slurmctld (and
    so torchpassd's watcher) can tell TorchPass jobs apart (22.05 shows neither the SPANK
    environment nor the submit line). A comment the user gave is kept after the marker.
Install: slurm.conf "CliFilterPlugins=cli_filter/lua" and this file as cli_filter.lua next to
slurm.conf (see spank/README.md).
]]

local function torchpass_request(options)
  local plugin = options["spank"] and options["spank"]["torchpass"]
  if plugin == nil then
    return nil
  end
  local mode, spares = plugin["torchpass"], plugin["torchpass-spares"]
  if mode == nil and spares == nil then
    return nil
  end
  if mode == nil or mode == "set" or mode == "" then
    mode = "auto"  -- a bare --torchpass reaches the filter as "set"
  end
  return mode, tonumber(spares) or 0
end

function slurm_cli_setup_defaults(options, early_pass)
  return slurm.SUCCESS
end

function slurm_cli_pre_submit(options, pack_offset)
  local mode, spares = torchpass_request(options)
  if mode == nil then
    return slurm.SUCCESS
  end
  options["no-kill"] = "set"
  local marker = string.format("torchpass:mode=%s,spares=%d", mode, spares)
  local comment = options["comment"]
  if comment == nil or comment == "" then
    options["comment"] = marker
  elseif not string.find(comment, "torchpass:mode=", 1, true) then
    options["comment"] = marker .. " " .. comment
  end
  return slurm.SUCCESS
end

function slurm_cli_post_submit(offset, job_id, step_id)
  return slurm.SUCCESS
end
