// An OpenID provider for Shepherd's tests (panva's oidc-provider), on loopback only.
// Usage: node oidc-idp.mjs MODULE_DIR PORT [WEB_REDIRECT_URI]
// (scripts/test-deps.sh installs MODULE_DIR).
// One client, `ci-pipeline`, gets JWT access tokens for audience `shepherd` by the client
// credentials grant, with the scopes it asks for among `shepherd:viewer shepherd:operator`.
// With a redirect URI, a second client, `shepherd-web`, signs people in by the authorization
// code flow with PKCE (the built-in login form takes any name and password). An account's
// `groups` claim, in its ID token when the `groups` scope is asked for, follows its name:
// `operator…` is in `shepherd-operators`, `viewer…` in `shepherd-viewers`, others in none.
// A third client, `shepherd-cli`, is `shepherd login`'s: native and public (no secret), any
// loopback port; its JWT access tokens (resource `urn:shepherd:api`) carry `groups` too.
// With IDP_GROUPS_FILE set, that file (a JSON object of name → groups, read at each use)
// overrides the groups of the names it lists: how a test moves a person to another group.
import { pathToFileURL } from 'node:url';
import { join } from 'node:path';
import { readFileSync } from 'node:fs';

const [moduleDir, port, webRedirect] = process.argv.slice(2);
const { default: Provider } = await import(
  pathToFileURL(join(moduleDir, 'node_modules', 'oidc-provider', 'lib', 'index.js')).href
);
const issuer = `http://127.0.0.1:${port}`;
const overrides = () => {
  try {
    return JSON.parse(readFileSync(process.env.IDP_GROUPS_FILE, 'utf8'));
  } catch {
    return {};
  }
};
const groupsOf = (name) => overrides()[name] ?? (
  name.startsWith('operator') ? ['shepherd-operators']
    : name.startsWith('viewer') ? ['shepherd-viewers'] : []);
const webClients = webRedirect ? [{
  client_id: 'shepherd-web',
  client_secret: 'shepherd-web-secret',
  grant_types: ['authorization_code'],
  response_types: ['code'],
  redirect_uris: [webRedirect],
  token_endpoint_auth_method: 'client_secret_basic',
}] : [];
const cliClient = {
  client_id: 'shepherd-cli',
  application_type: 'native',
  token_endpoint_auth_method: 'none',
  grant_types: ['authorization_code'],
  response_types: ['code'],
  redirect_uris: ['http://127.0.0.1/callback'],
};
const provider = new Provider(issuer, {
  scopes: ['openid', 'groups', 'shepherd:viewer', 'shepherd:operator'],
  claims: { openid: ['sub'], groups: ['groups'] },
  conformIdTokenClaims: false,
  findAccount: (ctx, id) => ({
    accountId: id,
    claims: () => ({ sub: id, groups: groupsOf(id) }),
  }),
  pkce: { required: () => true },
  extraTokenClaims: (ctx, token) => (token.accountId ? { groups: groupsOf(token.accountId) } : {}),
  clients: [...webClients, cliClient, {
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
