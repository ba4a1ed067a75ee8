// An OpenID provider for Shepherd's tests (panva's oidc-provider), on loopback only.
// Usage: node oidc-idp.mjs MODULE_DIR PORT (scripts/test-deps.sh installs MODULE_DIR).
// One client, `ci-pipeline`, gets JWT access tokens for audience `shepherd` by the client
// credentials grant, with the scopes it asks for among `shepherd:viewer shepherd:operator`.
import { pathToFileURL } from 'node:url';
import { join } from 'node:path';

const [moduleDir, port] = process.argv.slice(2);
const { default: Provider } = await import(
  pathToFileURL(join(moduleDir, 'node_modules', 'oidc-provider', 'lib', 'index.js')).href
);
const issuer = `http://127.0.0.1:${port}`;
const provider = new Provider(issuer, {
  scopes: ['openid', 'shepherd:viewer', 'shepherd:operator'],
  clients: [{
    client_id: 'ci-pipeline',
    client_secret: 'ci-pipeline-secret',
    grant_types: ['client_credentials'],
    redirect_uris: [],
    response_types: [],
    scope: 'shepherd:viewer shepherd:operator',
  }],
  features: {
    clientCredentials: { enabled: true },
    resourceIndicators: {
      enabled: true,
      defaultResource: () => 'urn:shepherd:api',
      getResourceServerInfo: () => ({
        scope: 'shepherd:viewer shepherd:operator',
        accessTokenFormat: 'jwt',
        audience: 'shepherd',
      }),
    },
  },
});
provider.listen(Number(port), '127.0.0.1', () => console.log(`idp: listening at ${issuer}`));
