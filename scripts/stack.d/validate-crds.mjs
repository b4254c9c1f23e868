// Validate custom resources against the validators that @kubernetes-models generates from the CRDs' OpenAPI
// schemas (kubeconform has no offline schemas for them here).
// Usage: CRD_MODULES=<node_modules> node validate-crds.mjs < docs.json   (a JSON array of manifests)
// Prints one JSON line per document: {"kind", "name", "valid", "error"}; exits 1 if any is invalid or unknown.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const MODELS = {
  "keda.sh/v1alpha1": "@kubernetes-models/keda/keda.sh/v1alpha1",
  "monitoring.coreos.com/v1": "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1",
};

const modules = process.env.CRD_MODULES;
if (!modules) {
  console.error("CRD_MODULES is not set (scripts/stack.d/tools.sh prints it)");
  process.exit(2);
}

let failed = false;
for (const doc of JSON.parse(readFileSync(0, "utf8"))) {
  const result = { kind: doc.kind, name: doc.metadata?.name, valid: false, error: null };
  const base = MODELS[doc.apiVersion];
  try {
    if (!base) throw new Error(`no validator for apiVersion ${doc.apiVersion}`);
    // a file URL, so the packages resolve from CRD_MODULES and not from this script's folder
    const url = pathToFileURL(join(modules, base, `${doc.kind}.js`)).href;
    const Model = (await import(url))[doc.kind];
    new Model(doc).validate();
    result.valid = true;
  } catch (err) {
    result.error = String(err.message ?? err);
    failed = true;
  }
  console.log(JSON.stringify(result));
}
process.exit(failed ? 1 : 0);
