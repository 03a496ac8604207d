// validate_k8s.js MODELS: validates Kubernetes objects (a JSON array on
// stdin) against the API schemas of MODELS, the directory of an install of
// the npm package kubernetes-models (deploy/fetch-helm.sh installs two, for
// two Kubernetes versions): types and required fields; unknown fields are
// not reported. Objects of kinds it does not know (ServiceMonitor) are
// listed as skipped. Prints one line per object and exits 1 if any is
// invalid. The module of an API version is imported by its path, as the
// newer releases are ES modules whose exports map a bare require misses.
const fs = require("fs");
const path = require("path");
const { pathToFileURL } = require("url");

async function kindOf(models, apiVersion, kind) {
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : ["", apiVersion];
  const dir = path.join(models, group, version);
  const file = ["index.mjs", "index.js"].map((f) => path.join(dir, f)).find(fs.existsSync);
  if (!file) return undefined;
  const module = await import(pathToFileURL(file).href);
  return module[kind] || (module.default && module.default[kind]);
}

async function main() {
  const models = process.argv[2];
  const objects = JSON.parse(fs.readFileSync(0, "utf8"));
  let bad = 0;
  for (const o of objects) {
    const Kind = await kindOf(models, o.apiVersion, o.kind);
    if (!Kind) {
      console.log(`skipped ${o.kind}/${o.metadata.name}: ${o.apiVersion} is not in ${models}`);
      continue;
    }
    try {
      new Kind(o).validate();
      console.log(`valid ${o.kind}/${o.metadata.name}`);
    } catch (e) {
      bad++;
      console.log(`invalid ${o.kind}/${o.metadata.name}: ${e.message}`);
    }
  }
  process.exit(bad ? 1 : 0);
}

main();
